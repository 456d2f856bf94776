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
import datetime as dt
import json
import os
import re
import shutil
import socket
import sys
import time
import tomllib
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from minions_local.core.errors import MinionsError
from minions_local.profile import load_profile, measure
from minions_local.profile.loader import apply_overrides, find_profile_file, generated_dir, shipped_dir
from minions_local.profile.writer import dumps

MODES = {
    # disk file, copy size, matmul sizes, seconds per timing, widths, target tokens
    "tiny": dict(disk=16 << 20, copy=16 << 20, sizes=(128, 256), t=0.02, widths=(1, 4), tokens=(1, 8), models=False),
    "quick": dict(disk=256 << 20, copy=128 << 20, sizes=(256, 512, 1024), t=0.1, widths=(1, 4, 16),
                  tokens=(1, 16, 64), models=True),
    "full": dict(disk=1 << 30, copy=512 << 20, sizes=(256, 512, 1024, 2048), t=0.3, widths=(1, 2, 4, 8, 16, 32),
                 tokens=(1, 4, 16, 64, 256), models=True),
}
MODEL_RAM_SHARE = 0.25  # time models only if their weights fit in this share of RAM


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


def default_out(template_name: str) -> Path:
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:32] or "this-machine"
    return generated_dir() / f"{template_name.removeprefix('generated/')}-{host}.toml"


def measure_all(template, mode: dict, args, progress: Progress) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtypes = ["bfloat16", "float32"] + (["float16"] if device == "cuda" else [])
    disk_path = Path(args.disk_path or template.hardware.disk_path).expanduser()
    r: dict = {"device": device, "disk_path": str(disk_path), "matmul": [], "grow": [], "target_layer": []}
    if device == "cuda":
        r["device_name"] = torch.cuda.get_device_name(0)
        r["device_total_gb"] = torch.cuda.get_device_properties(0).total_memory / 1e9
    else:
        r["device_name"] = f"CPU ({torch.get_num_threads()} threads)"

    task = progress.add_task("disk, copies, memory", total=4)
    r["disk"] = measure.disk_read_speeds(disk_path, mode["disk"])
    progress.advance(task)
    r["copy"] = measure.copy_speeds(mode["copy"], mode["t"])
    progress.advance(task)
    r["weight_read_gbps"] = measure.weight_read_gbps(device, template.target.dtype, mode["copy"], mode["t"])
    progress.advance(task)
    # A transformers forward of a tiny model; --tiny keeps the template's figure instead
    # (importing transformers alone takes seconds on a busy machine).
    r["layer_overhead_ms"] = (measure.layer_overhead_ms(device, mode["t"]) if mode["models"]
                              else template.hardware.layer_overhead_ms)
    progress.advance(task)

    # A GPU reaches its peak only on larger matrices than a CPU does.
    sizes = [n * 4 for n in mode["sizes"]] if device == "cuda" else mode["sizes"]
    task = progress.add_task("matmul by size and dtype", total=len(dtypes) * len(sizes))
    for dtype in dtypes:
        for n in sizes:
            r["matmul"].append({"dtype": dtype, "size": n, "tflops": measure.matmul_tflops(device, dtype, n, mode["t"])})
            progress.advance(task)

    if mode["models"] and not args.no_models:
        measure_models(template, mode, device, r, progress)
    return r


def measure_models(template, mode, device, r, progress) -> None:
    models = [(m.name, m.path, m.dtype, "grow", mode["widths"]) for m in template.minions if m.kind == "hf"]
    models.append(("target", template.target.path, template.target.dtype, "target_layer", mode["tokens"]))
    r["skipped"] = []
    for name, path, dtype, kind, sizes in models:
        reason = _why_not_timed(path)
        if reason:
            r["skipped"].append(f"{name}: {reason}")
            continue
        task = progress.add_task(f"{name} by {'width' if kind == 'grow' else 'tokens'}", total=len(sizes))
        model = measure.load_for_timing(path, dtype, device)
        per = model.config.num_hidden_layers if kind == "target_layer" else 1
        for n in sizes:
            seconds = measure.forward_seconds(model, n, prefix=128, min_seconds=mode["t"])
            r[kind].append({"model": name, "tokens": n, "seconds": seconds / per})
            progress.advance(task)
        del model


def _why_not_timed(path: str | None) -> str | None:
    if not path or not (Path(path) / "config.json").is_file():
        return "not on this machine"
    size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size == 0:
        return "no safetensors weights"
    if size > MODEL_RAM_SHARE * ram:
        return f"{size / 1e9:.0f} GB of weights: too large to time here (the layer store's bench does)"
    return None


def build_profile(raw: dict, template, r: dict, out: Path, mode: str) -> str:
    """The template's models and limits with this machine's measured hardware."""
    hw = template.hardware
    ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    free_gb = shutil.disk_usage(r["disk_path"]).free / 1e9
    disk = r["disk"]
    tflops: dict[str, float] = {}
    for s in r["matmul"]:
        tflops[s["dtype"]] = round(max(tflops.get(s["dtype"], 0.0), s["tflops"]), 4)
    cuda = r["device"] == "cuda"
    hardware = {
        "device": r["device"],
        "device_name": r["device_name"],
        "device_memory_gb": round(0.92 * r["device_total_gb"], 1) if cuda else min(hw.device_memory_gb, round(0.5 * ram_gb, 1)),
        "device_reserve_gb": 1.0 if cuda else 0.0,
        "device_memory_gbps": r["weight_read_gbps"],
        "host_ram_gb": min(hw.host_ram_gb, round(0.6 * ram_gb if cuda else 0.25 * ram_gb, 1)),
        "disk_path": r["disk_path"],
        "disk_budget_gb": min(hw.disk_budget_gb, round(0.8 * free_gb, 1)),
        "disk_read_gbps": disk["direct"] or disk["fadvise"],
        "host_to_device_gbps": r["copy"]["pinned"] or r["copy"]["memcpy"],
        "host_to_device_pageable_gbps": r["copy"]["pageable"],
        "compute_tflops": tflops,
        "layer_overhead_ms": r["layer_overhead_ms"],
    }
    data = {
        "description": f"{template.description} (measured)" if template.description else "measured",
        "hardware": hardware,
    }
    data.update((k, v) for k, v in raw.items() if k not in ("name", "description", "hardware", "measurements"))
    data["measurements"] = {
        "tool": f"scripts/autotune.py --{mode}",
        "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "disk_read_cached_gbps": disk["cached"],
        "matmul": r["matmul"],
        "grow": r["grow"],
        "target_layer": r["target_layer"],
    }
    header = (f"Generated by scripts/autotune.py --{mode} on {socket.gethostname()} from template "
              f"'{template.name}'.\nRe-run autotune rather than editing; copy it out of generated/ to keep it.")
    return dumps(_relative_paths(data, out), header)


def _relative_paths(data: dict, out: Path) -> dict:
    """Plain relative model paths in the template were relative to it: make them absolute."""
    def fix(section: dict) -> dict:
        path = section.get("path")
        if path and ":" not in path and not path.startswith(("/", "~")):
            section = {**section, "path": str((shipped_dir() / path).resolve())}
        return section
    data["target"] = fix(dict(data["target"]))
    data["minions"] = [fix(dict(m)) for m in data.get("minions", [])]
    return data


def report(r: dict, out: Path, seconds: float, mode: str) -> dict:
    disk, copy = r["disk"], r["copy"]
    best = {}
    for s in r["matmul"]:
        best[s["dtype"]] = max(best.get(s["dtype"], 0.0), s["tflops"])
    table = Table(title=f"autotune --{mode}: {r['device_name']}")
    table.add_column("measurement")
    table.add_column("value", justify="right")
    rows = [
        ("disk read, O_DIRECT", _fmt(disk["direct"], "GB/s")),
        ("disk read, after fadvise(DONTNEED)", _fmt(disk["fadvise"], "GB/s")),
        ("disk read, page cache", _fmt(disk["cached"], "GB/s")),
        ("host->device pinned", _fmt(copy["pinned"], "GB/s")),
        ("host->device pageable", _fmt(copy["pageable"], "GB/s")),
        ("memcpy", _fmt(copy["memcpy"], "GB/s")),
        ("weight read (1-token matmul)", _fmt(r["weight_read_gbps"], "GB/s")),
        ("layer overhead", _fmt(r["layer_overhead_ms"], "ms")),
    ]
    rows += [(f"matmul {d} (best size)", _fmt(v, "TFLOP/s")) for d, v in best.items()]
    rows += [(f"{s['model']} forward, width {s['tokens']}", _fmt(s["seconds"] * 1e3, "ms")) for s in r["grow"]]
    rows += [(f"target layer, {s['tokens']} tokens", _fmt(s["seconds"] * 1e3, "ms")) for s in r["target_layer"]]
    rows += [("skipped", s) for s in r.get("skipped", [])]
    for row in rows:
        table.add_row(*row)
    table.add_row("profile written", str(out))
    Console().print(table)
    return {
        "profile": str(out),
        "mode": mode,
        "device": r["device"],
        "disk_read_direct_gbps": disk["direct"],
        "disk_read_fadvise_gbps": disk["fadvise"],
        "disk_read_cached_gbps": disk["cached"],
        "host_to_device_pinned_gbps": copy["pinned"],
        "host_to_device_pageable_gbps": copy["pageable"],
        "memcpy_gbps": copy["memcpy"],
        "weight_read_gbps": r["weight_read_gbps"],
        "layer_overhead_ms": r["layer_overhead_ms"],
        "compute_tflops": best,
        "grow_samples": len(r["grow"]),
        "target_layer_samples": len(r["target_layer"]),
        "seconds": round(seconds, 1),
    }


def _fmt(value, unit: str) -> str:
    return "-" if value is None else f"{value:.3g} {unit}"


if __name__ == "__main__":
    sys.exit(main())
