"""What one bench.py run measures: its settings (--tiny, --quick or full), the models
(the demo family, given folders, or random stand-ins) and the profile for the tier."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from minions_local.models.demo import DEMO_DIR as DEMO

DEMO_MINIONS = ("minion-llama-s", "minion-qwen2-xs", "minion-mistral-m")


def resolve_models(args: argparse.Namespace) -> tuple[Path, list[Path], list[str]]:
    notes: list[str] = []
    if args.tiny or args.standins:
        from benchmarks.standins import build_standins

        paths = build_standins(Path(tempfile.mkdtemp(prefix="bench-standins-")), tiny=args.tiny)
        notes.append("STAND-IN random models: speeds are real, acceptance (and so speedups) is not")
        return paths["target"], [paths[n] for n in DEMO_MINIONS], notes
    target = args.target or DEMO / "target"
    minions = args.minion or [DEMO / n for n in DEMO_MINIONS]
    missing = [p for p in [target, *minions] if not (p / "config.json").is_file()]
    if missing:
        sys.exit(f"error: no model at {', '.join(map(str, missing))}. The demo family is made by "
                 "scripts/train_demo_family.py; until then pass --target/--minion, or --standins.")
    return target, minions, notes


def resolve_profile(profile: str, tier: str) -> str:
    """'cpu-demo' + disk -> the shipped 'cpu-demo-disk' when it exists (its memory plan
    streams every layer from disk); otherwise the profile itself with the tier overridden."""
    from minions_local.profile.loader import find_profile_file

    if tier == "disk" and not profile.endswith(".toml"):
        try:
            find_profile_file(f"{profile}-disk")
            return f"{profile}-disk"
        except Exception:  # noqa: BLE001 - no such profile: fall back to the override below
            pass
    return profile


def settings(args: argparse.Namespace) -> dict:
    if args.tiny:
        base = dict(prompts=2, prompt_tokens=24, max_new=10, threads="1", fixed=[8], chains=1, assisted=1,
                    dtypes=["fp32"], gguf=["f32"])
    elif args.quick:
        base = dict(prompts=3, prompt_tokens=200, max_new=64, threads="1", fixed=[8, 32, 128], chains=1,
                    assisted=1, dtypes=["bf16"], gguf=["f16"])
    else:
        base = dict(prompts=6, prompt_tokens=200, max_new=128, threads="auto", fixed=[8, 16, 32, 64, 128],
                    chains=3, assisted=3, dtypes=["fp32", "bf16"], gguf=["f16", "q8_0"])
    if args.tier == "disk" and not (args.quick or args.tiny):
        # accelerate reads each offloaded weight from disk on every pass (~2x our
        # autoregressive pass time): fewer rounds keep the full disk run under 30 minutes.
        base["prompts"] = 4
    for key in ("prompts", "prompt_tokens", "max_new", "threads"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    return base
