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
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Sleeping OpenMP workers: spinning ones slow everyone down on a shared 2-core box.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from benchmarks import report  # noqa: E402
from benchmarks.choices import resolve_models, resolve_profile, settings  # noqa: E402
from benchmarks.lineup import Lineup  # noqa: E402
from benchmarks.prompts import held_out_prompts  # noqa: E402
from benchmarks.rounds import TEMPERATURE, calibrate, interleaved  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


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
        "prediction_error": errors, "time_split": splits, "accepted_histogram": report.histogram(accepted), "goals": goals,
        "notes": lineup.notes, "plot": str(plot), "seconds": round(time.perf_counter() - started, 1),
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
