"""Tokens per target pass and speed of our engine's budget policies, decode only.

    python scripts/bench_budgets.py [--profile stdlib-demo|stdlib-demo-disk] [--prompts 6] [--tokens 128]

Where `bench.py` compares against other systems (cold calls, prefill included), this
isolates the engine: the same loaded profile, the same held-out third-party prompts,
warm caches, decode time only. Methods: autoregressive (no minions), the engine's
defaults (`Engine.from_pretrained` with the three demo minions), fixed budgets, the
profile's cost-model policy and the adaptive-depth policy. Methods are interleaved
with a rotating order per prompt; ratios are against autoregressive in the same run.
Ends with one JSON line. Issue 3's figure (>= 3 tokens per pass with the default
budget) is `tokens_per_pass["defaults"]`.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.choices import DEMO, DEMO_MINIONS
from benchmarks.prompts import held_out_prompts
from minions_local import Engine
from minions_local.engine.from_profile import engine_kwargs_from_profile
from minions_local.speculation.budget import FixedBudget


def build_engines(profile: str) -> dict[str, Engine]:
    base = {**engine_kwargs_from_profile(profile), "memory_plan": None}
    engines = {
        "autoregressive": Engine.from_pretrained(**{**base, "minions": []}),
        "defaults": Engine.from_pretrained(DEMO / "target", [DEMO / m for m in DEMO_MINIONS], dtype="bfloat16",
                                           target_tier=base["target_tier"], stream_options=base["stream_options"]),
    }
    for nodes, depth in ((8, 6), (16, 8), (32, 8)):
        engines[f"fixed {nodes}"] = Engine.from_pretrained(**{**base, "budget": FixedBudget(nodes, depth)})
    engines["adaptive (profile cost model)"] = Engine.from_profile(profile)
    engines["adaptive depth"] = Engine.from_pretrained(**{**base, "budget": "adaptive"})
    return engines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="stdlib-demo",
                        help="stdlib-demo (RAM tier) or stdlib-demo-disk: the stdlib family, whose three minions "
                             "'defaults' loads")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is faster for these small models on a busy 2-core box)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    engines = build_engines(args.profile)
    prompts = held_out_prompts(engines["autoregressive"].tokenizer, args.prompts, prompt_tokens=150)
    totals = {label: {"tokens": 0, "passes": 0, "seconds": 0.0} for label in engines}
    for i, prompt in enumerate(prompts):
        order = list(engines.items())
        for label, engine in order[i % len(order):] + order[: i % len(order)]:  # rotate: fair to all
            out = engine.generate(prompt.ids, max_new_tokens=args.tokens)
            t = totals[label]
            t["tokens"] += len(out.token_ids)
            t["passes"] += len(out.steps)
            t["seconds"] += out.decode_seconds

    speed = {k: t["tokens"] / t["seconds"] for k, t in totals.items()}
    per_pass = {k: t["tokens"] / t["passes"] for k, t in totals.items()}
    vs_ar = {k: v / speed["autoregressive"] for k, v in speed.items()}
    fixed = {k: v for k, v in speed.items() if k.startswith("fixed")}
    best_fixed = max(fixed, key=fixed.get)
    print(f"{'method':32} {'tok/pass':>9} {'tok/s':>8} {'vs AR':>7}")
    for label in engines:
        print(f"{label:32} {per_pass[label]:9.2f} {speed[label]:8.1f} {vs_ar[label]:6.2f}x")
    print(json.dumps({
        "profile": args.profile, "threads": args.threads, "prompts": len(prompts), "tokens": args.tokens,
        "tokens_per_pass": per_pass, "tokens_per_second": speed, "vs_autoregressive": vs_ar,
        "best_fixed": best_fixed,
        "adaptive_vs_best_fixed": speed["adaptive (profile cost model)"] / fixed[best_fixed],
        "goal_default_3_tokens_per_pass": per_pass["defaults"] >= 3.0,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
