"""Measure this machine and write a profile for it.

    python scripts/autotune.py [--quick | --tiny] [--profile TEMPLATE] [--out PATH]

Measures disk reads around the page cache (O_DIRECT, and buffered after
posix_fadvise(DONTNEED)), host->device copies (pinned and pageable on CUDA; a memcpy
on a CPU box), the rate a one-token matmul reads weights, matmul TFLOP/s by size and
dtype, the per-layer launch overhead of a transformers forward, and, when the
template's models are on disk, each minion's forward time by tree width and the
target's time per layer by tokens.

The models, tree limits and budgets come from a template profile (default cpu-demo);
the measured hardware replaces the template's. The result goes to
profiles/generated/ (never over a hand-written profile), and load_profile() reads it.
Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from autotuning.output import build_profile, default_out, report
from autotuning.sweep import MODES, measure_all
from minions_local.core.errors import MinionsError
from minions_local.profile import load_profile
from minions_local.profile.loader import apply_overrides, find_profile_file, shipped_dir


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    console = Console(stderr=True)
    try:
        template_path = find_profile_file(args.profile)
        template = load_profile(template_path, target=args.target, minions=args.minion)
    except MinionsError as err:
        console.print(f"[red]error:[/] {err}")
        return 2
    out = Path(args.out) if args.out else default_out(template.name)
    if out.resolve().parent == shipped_dir().resolve():
        console.print(f"[red]error:[/] refusing to write over a hand-written profile: {out}")
        return 2
    started = time.perf_counter()
    with Progress(TextColumn("{task.description:<34}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        results = measure_all(template, MODES[mode], args, progress)
    raw = apply_overrides(tomllib.loads(template_path.read_text()), target=args.target, minions=args.minion,
                           tier=None)
    text = build_profile(raw, template, results, out, mode)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    load_profile(out)  # what we write must load; fail loudly here, not at the next chat
    summary = report(results, out, time.perf_counter() - started, mode)
    print(json.dumps(summary))
    return 0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    speed = p.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_true", help="smaller files and fewer sizes (< 2 min)")
    speed.add_argument("--tiny", action="store_true", help="seconds, no model timings (for tests)")
    p.add_argument("--profile", default="cpu-demo", help="template profile: models and limits (default cpu-demo)")
    p.add_argument("--out", help="where to write (default profiles/generated/TEMPLATE-HOST.toml)")
    p.add_argument("--target", help="time this target model instead of the template's")
    p.add_argument("--minion", action="append", help="time this minion instead of the template's (repeat)")
    p.add_argument("--disk-path", help="folder to measure and stream from (default: the template's)")
    p.add_argument("--no-models", action="store_true", help="skip minion and target timings")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
