"""What one bench.py run measures: its settings (--tiny, --quick or full), the
profile and tier, and the models (the profile's own, or tiny random stand-ins)."""

from __future__ import annotations

import argparse
from pathlib import Path

from minions_local.offload.dtypes import cpu_has_bf16_matmul

DEMO_MINIONS = ("minion-llama-s", "minion-qwen2-xs", "minion-mistral-m")
TINY_PROFILE = "stdlib-demo-disk"
"""--tiny runs the stdlib family's profile (disk tier unless --tier ram) with random stand-ins in its place."""


def resolve_tier(profile: str, tier: str | None) -> str:
    """The tier asked for, else the profile's own ('device' counts as RAM on a CPU)."""
    if tier:
        return tier
    from minions_local.profile import load_profile

    own = load_profile(profile).target.tier
    return "disk" if own == "disk" else "ram"


def resolve_profile(profile: str, tier: str | None) -> str:
    """The shipped profile for the tier asked: 'cpu-demo' + disk -> 'cpu-demo-disk' (its
    memory plan streams every layer from disk), 'cpu-demo-disk' + ram -> 'cpu-demo';
    otherwise the profile itself (the tier is then an override)."""
    from minions_local.profile.loader import find_profile_file

    if profile.endswith(".toml") or tier is None:
        return profile
    base = profile.removesuffix("-disk")
    wanted = f"{base}-disk" if tier == "disk" else base
    try:
        find_profile_file(wanted)
        return wanted
    except Exception:  # noqa: BLE001 - no such profile: fall back to the override
        return profile


def standin_overrides(workdir: Path, notes: list[str]) -> dict:
    """target= / minions= for the tiny stand-ins: random models in the stdlib family's
    smallest shapes (written under `workdir`), plus the n-gram minion."""
    from benchmarks.standins import build_standins

    paths = build_standins(workdir / "standins", tiny=True)
    notes.append("STAND-IN random models: speeds are real, acceptance (and so speedups) is not")
    return {"target": str(paths["target"]), "minions": [str(paths[n]) for n in DEMO_MINIONS] + ["ngram"]}


def settings(args: argparse.Namespace) -> dict:
    """prompts, max_new, threads, dtypes, gguf, fixed, calibration (tokens, repeats)."""
    if args.tiny:
        base = dict(prompts=2, max_new=10, threads=[1], dtypes=["fp32"], gguf=["f32"], fixed=[8],
                    calibration=(4, 1))
    elif args.quick:
        base = dict(prompts=3, max_new=48, threads=[1, 2], dtypes=["bf16", "fp32"], gguf=["q4_1", "f16"],
                    fixed=[16, 64], calibration=(16, 1))
    else:
        base = dict(prompts=8, max_new=128, threads=[1, 2], dtypes=["bf16", "fp32"], gguf=["q4_1", "f16"],
                    fixed=[16, 64, 256], calibration=(32, 2))
    if args.prompts is not None:
        base["prompts"] = args.prompts
    if args.max_new is not None:
        base["max_new"] = args.max_new
    if args.threads is not None:
        base["threads"] = [int(t) for t in args.threads.split(",")]
    if args.dtypes is not None:
        base["dtypes"] = args.dtypes.split(",")
    elif "bf16" in base["dtypes"] and not cpu_has_bf16_matmul() and _on_cpu(args.profile):
        # Our engine widens streamed bf16 weights to float32 math here (the trees' gain);
        # its baseline must also get bf16 math, which a 1-token pass does faster.
        base["dtypes"].insert(1, "bf16:bf16")
    if args.fixed is not None:
        base["fixed"] = [int(n) for n in args.fixed.split(",")]
    return base


def _on_cpu(profile: str) -> bool:
    from minions_local.profile import load_profile

    return load_profile(profile).hardware.device == "cpu"
