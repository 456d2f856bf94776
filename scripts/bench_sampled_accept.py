"""Accepted draft tokens per target pass, greedy and sampled, for a few tree shapes.

The sampled-tree figures (issue: sampled drafts) come from this script: one shared
target, engines that differ only in minions and budget, 3 held-out prompts, 64 tokens.

Measured (accepted draft tokens per pass, T=0.7, 3 prompts; `seeded` keeps fixed drafts
and SpecExec's rule so that a seed repeats exactly, `sampled` draws the drafts and
verifies by recursive rejection sampling):
  one minion, 8 nodes        seeded 0.59   sampled 2.49
  all minions, 8 nodes       seeded 0.56   sampled 2.05
  all minions, 32 nodes      seeded 0.73   sampled 3.09
Greedy (T=0): 1.29 / 1.78 / 2.69.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from benchmarks.methods import engine_sharing_target
from benchmarks.prompts import held_out_prompts
from minions_local.engine import Engine
from minions_local.speculation.budget import FixedBudget


def mean_accepted(engine: Engine, prompts, temperature: float, tokens: int, seeded: bool) -> float:
    """Accepted draft tokens per pass. Seeded requests keep fixed drafts (SpecExec's rule,
    reproducible); unseeded ones draw their drafts (random.seed keeps them repeatable)."""
    steps = []
    for i, p in enumerate(prompts):
        random.seed(i)
        gen = engine.generate(p.ids, max_new_tokens=tokens, temperature=temperature, seed=i if seeded else None)
        steps += [s.accepted for s in gen.steps]
    return sum(steps) / len(steps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--temperatures", default="0.0,0.7")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = Engine.from_profile("stdlib-demo", threads=1)
    prompts = held_out_prompts(base.tokenizer, args.prompts, 200)
    minions = base.decoder.minions
    shapes = {
        f"chain {minions[0].name} 8": ([minions[0]], FixedBudget(8, 12)),
        "all FixedBudget(8,12)": (minions, FixedBudget(8, 12)),
        "all FixedBudget(32,12)": (minions, FixedBudget(32, 12)),
    }
    print("minions:", [m.name for m in minions])
    result: dict = {"bench": "sampled_accept", "prompts": len(prompts), "tokens": args.tokens, "accepted_per_pass": {}}
    for label, (ms, policy) in shapes.items():
        engine = engine_sharing_target(base, ms, policy, selection="all")
        row = result["accepted_per_pass"][label] = {}
        for t in (float(x) for x in args.temperatures.split(",")):
            for seeded in ((False,) if t == 0 else (False, True)):
                regime = "greedy" if t == 0 else "seeded" if seeded else "sampled"
                value = mean_accepted(engine, prompts, t, args.tokens, seeded)
                row[f"{regime} T={t:g}"] = round(value, 3)
                print(f"{label:28s} {regime:8s} T={t:.1f}  accepted/step {value:.2f}", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
