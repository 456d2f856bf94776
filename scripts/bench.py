#!/usr/bin/env python
"""Our engine against the peers, in one interleaved run on the same held-out prompts.

    python scripts/bench.py --profile cpu-demo [--tier ram|disk] [--quick] [--out DIR]
    python scripts/bench.py --standins --quick     # random models in the family's shapes
    python scripts/bench.py --tiny                 # seconds: the smoke test's run

Methods: the target alone through our engine (the baseline), transformers `generate`
(plain, and assisted by each minion), our engine with one minion as a chain, with
fixed budgets, and with the profile's adaptive policy; llama.cpp on the target as a
GGUF with and without prompt lookup (RAM tier, when llama_cpp is installed).
Rounds go prompt by prompt, greedy then sampled (temperature 0.7, fixed seeds), and
every method runs in every round, its start rotated, so load from other processes
hits all methods alike; figures are ratios to the baseline of the same round. Without
--quick, a calibration round first picks each method's fastest thread count and
dtype (weight type for llama.cpp). Prints a table, writes a PNG plot into --out, and
ends with ONE JSON line holding every figure and the goal checks.

Measured on the shared 2-core box with the demo family: --quick takes ~1.5 min (RAM
tier) / ~3.5 min (disk tier); the full run ~13 min (RAM) / ~9 min (disk, 4 prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Sleeping OpenMP workers: spinning ones slow everyone down on a shared 2-core box.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import bench_report as report  # noqa: E402
from bench_lineup import Lineup  # noqa: E402
from bench_methods import Method, Run  # noqa: E402
from bench_prompts import held_out_prompts  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "minions_local" / "demo_models"
DEMO_MINIONS = ("minion-llama-s", "minion-qwen2-xs", "minion-mistral-m")
TEMPERATURE = 0.7


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="cpu-demo", help="hardware profile (its policy is the adaptive engine)")
    p.add_argument("--tier", choices=["ram", "disk"], default="ram", help="where the target's layers live")
    p.add_argument("--quick", action="store_true", help="few prompts, short replies, fewer methods, no calibration")
    p.add_argument("--tiny", action="store_true", help="tiny random stand-ins, a few tokens: checks the machinery")
    p.add_argument("--standins", action="store_true", help="random models in the demo family's shapes")
    p.add_argument("--target", type=Path, default=None, help="target HF folder (default: the demo family's)")
    p.add_argument("--minion", type=Path, action="append", default=None, help="minion HF folder (repeatable)")
    p.add_argument("--out", type=Path, default=REPO / "bench_out", help="folder for the plot")
    p.add_argument("--prompts", type=int, default=None, help="held-out prompts (rounds per mode)")
    p.add_argument("--prompt-tokens", type=int, default=None)
    p.add_argument("--max-new", type=int, default=None, help="new tokens per generation")
    p.add_argument("--modes", default="greedy,sampled")
    p.add_argument("--threads", default=None, help="'auto' (calibrate 1 and 2), or a fixed count")
    p.add_argument("--no-llama-cpp", action="store_true")
    return p.parse_args(argv)


def resolve_models(args: argparse.Namespace) -> tuple[Path, list[Path], list[str]]:
    notes: list[str] = []
    if args.tiny or args.standins:
        from bench_standins import build_standins

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


def calibrate(groups: list[list[Method]], ids: list[int], max_new: int, repeats: int = 2) -> list[Method]:
    """The fastest candidate of each group, on one prompt, candidates interleaved."""
    best: dict[int, float] = {}
    for _ in range(repeats):
        for g, group in enumerate(groups):
            for c, method in enumerate(group):
                if len(group) == 1:
                    continue
                run = method.run(ids, max_new, 0.0, 0)
                key = g * 1000 + c
                best[key] = min(best.get(key, float("inf")), run.seconds / max(len(run.tokens), 1))
    return [min(enumerate(group), key=lambda ic: best.get(g * 1000 + ic[0], 0.0))[1] for g, group in enumerate(groups)]


def interleaved(methods: list[Method], prompts, modes: list[str], max_new: int,
                log) -> tuple[list[dict[str, Run]], list[str]]:
    rounds: list[dict[str, Run]] = []
    round_modes: list[str] = []
    for i, prompt in enumerate(prompts):
        for mode in modes:
            k = len(rounds) % len(methods)
            order = methods[k:] + methods[:k]  # nobody always runs first (or right after a given neighbour)
            temperature = 0.0 if mode == "greedy" else TEMPERATURE
            runs = {m.name: m.run(prompt.ids, max_new, temperature, seed=1000 + i) for m in order}
            rounds.append(runs)
            round_modes.append(mode)
            base = runs[report.BASELINE].tokens_per_second
            ratios = [f"{n} {r.tokens_per_second / base:.2f}x" for n, r in runs.items() if base and n != report.BASELINE]
            log(f"round {len(rounds)} ({prompt.source}, {mode}): baseline {base:.1f} tok/s; " + ", ".join(ratios))
    return rounds, round_modes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)  # noqa: E731
    cfg = settings(args)
    target, minions, notes = resolve_models(args)
    profile = resolve_profile(args.profile, args.tier)
    threads = [1, 2] if cfg["threads"] == "auto" else [int(cfg["threads"])]
    lineup = Lineup(target=target, minions=minions, profile=profile, tier=args.tier, threads=threads,
                    hf_dtypes=cfg["dtypes"], gguf_types=cfg["gguf"], fixed_budgets=cfg["fixed"],
                    chain_minions=minions[: cfg["chains"]], assisted_minions=minions[: cfg["assisted"]],
                    llama_cpp=not args.no_llama_cpp, n_ctx=cfg["prompt_tokens"] + cfg["max_new"] + 64, notes=notes)
    log(f"loading: profile {profile}, tier {args.tier}, target {target}")
    groups = lineup.build()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = held_out_prompts(tokenizer, cfg["prompts"], cfg["prompt_tokens"])
    extra = held_out_prompts(tokenizer, 1, cfg["prompt_tokens"], skip=cfg["prompts"])[0]  # never measured
    log(f"{len(prompts)} prompts: {', '.join(p.source for p in prompts)}")
    for group in groups:  # warm-up: first calls pay for kernel selection, page cache, allocations
        for method in group:
            method.run(extra.ids, 4, 0.0, 0)
    methods = calibrate(groups, extra.ids, min(32, cfg["max_new"])) if len(threads) > 1 or len(cfg["dtypes"]) > 1 \
        else [g[0] for g in groups]
    log("chosen: " + "; ".join(f"{m.name}: {m.detail}, {m.threads} thread(s)" for m in methods))
    modes = [m for m in args.modes.split(",") if m]
    rounds, round_modes = interleaved(methods, prompts, modes, cfg["max_new"], log)

    summary = report.summarize(rounds, round_modes)
    adaptive = [m.name for m in methods if m.family == "adaptive"]
    adaptive_runs = [r[adaptive[0]] for r in rounds] if adaptive else []
    errors = report.prediction_errors(adaptive_runs)
    goals = report.goal_checks(args.tier, summary, methods, errors)
    best_hf = goals["ram_vs_best_transformers"].get("best_transformers")
    accepted = [s.accepted for run in adaptive_runs for s in run.steps]
    title = f"{profile} ({args.tier} tier), {len(prompts)} prompts x {cfg['max_new']} tokens"
    report.print_table(report.table_rows(summary, methods), title)
    args.out.mkdir(parents=True, exist_ok=True)
    plot = report.write_plot(args.out / f"bench-{args.tier}{'-quick' if args.quick else ''}.png", summary, methods,
                             accepted, title)
    splits = {m.name: report.time_split([r[m.name] for r in rounds]) for m in methods
              if m.family in ("autoregressive", "chain", "fixed", "adaptive")}
    print("where our engine's time goes (share of wall time; ms per pass = grow + verify):")
    for name, split in splits.items():
        print(f"  {name:<28} " + ", ".join(f"{k} {v}" for k, v in split.items()))
    for key, check in goals.items():
        state = {True: "PASS", False: "FAIL", None: "n/a"}[check["passed"]]
        print(f"goal {key}: {check['value']} (goal {check['goal']}) {state}")
    print(f"prediction error (median, relative): {errors}")
    for note in lineup.notes:
        print(f"note: {note}")
    print(f"plot: {plot}")
    result = {
        "profile": profile, "tier": args.tier, "quick": args.quick, "tiny": args.tiny,
        "standins": bool(args.tiny or args.standins), "target": str(target), "minions": [str(p) for p in minions],
        "prompts": [p.source for p in prompts], "prompt_tokens": cfg["prompt_tokens"], "max_new_tokens": cfg["max_new"],
        "modes": modes, "temperature": TEMPERATURE, "methods": report.as_json(summary, methods, best_hf),
        "best_transformers": goals["ram_vs_best_transformers"].get("best_transformers"),
        "best_fixed": goals["adaptive_vs_best_fixed"].get("best_fixed"),
        "prediction_error": errors, "time_split": splits, "accepted_histogram": _histogram(accepted), "goals": goals,
        "notes": lineup.notes, "plot": str(plot), "seconds": round(time.perf_counter() - started, 1),
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    return 0


def _histogram(values: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in sorted(values):
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


if __name__ == "__main__":
    sys.exit(main())
