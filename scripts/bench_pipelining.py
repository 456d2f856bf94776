#!/usr/bin/env python
"""Would pipelined drafting pay? An upper bound, measured on the demo family.

Minions/SPIN pipeline draft and verify: while the target verifies step t, the minions
already grow step t+1's tree from the most likely outcome of step t. That work is
useful only when step t ends exactly as predicted: the accepted path runs to the
predicted leaf AND the target's bonus token there is the predicted one. This script
runs the engine (stdlib-demo profile: the stdlib family) on held-out code prompts and counts how often the
accepted path ends at the tree's most probable leaf: a bound on the hit rate that
ignores the bonus token, so the real rate is lower. The saving is at most
hit rate x (grow share of a step), before the cost of two threads sharing the cores.

    python scripts/bench_pipelining.py [--prompts 4] [--max-new 96]

Prints the bound per mode and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.prompts import held_out_prompts
from minions_local import Engine
from minions_local.core.events import TreeSnapshot


def most_probable_leaf(tree: TreeSnapshot) -> int:
    has_child = set(tree.parents)
    leaves = [i for i in range(1, len(tree.tokens)) if i not in has_child]
    return max(leaves, key=lambda i: tree.scores[i])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="stdlib-demo",
                    help="the stdlib family's profile: the held-out prompts are code it never saw")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = Engine.from_profile(args.profile, threads=1)
    prompts = held_out_prompts(engine.tokenizer, args.prompts, 200)
    result = {"bench": "pipelining", "profile": args.profile, "prompts": len(prompts), "max_new": args.max_new}
    for name, temperature in (("greedy", 0.0), ("sampled", 0.7)):
        steps = hits = 0
        grow = total = 0.0
        for i, prompt in enumerate(prompts):
            engine.reset()
            out = engine.generate(prompt.ids, max_new_tokens=args.max_new, temperature=temperature, seed=i)
            for s in out.steps:
                grow += s.t_grow
                total += s.t_grow + s.t_verify
                if s.tree is None or len(s.tree.tokens) <= 1:
                    continue
                steps += 1
                hits += s.tree.accepted_path[-1] == most_probable_leaf(s.tree)
        bound = hits / steps if steps else 0.0
        share = grow / total if total else 0.0
        print(f"{name:8s} accepted path ended at the most probable leaf in {hits}/{steps} steps ({bound:.2f}); "
              f"grow is {share:.2f} of a step: pipelining could save at most {bound * share:.1%} of step time")
        result[name] = {"hit_rate_bound": round(bound, 3), "grow_share": round(share, 3),
                        "saving_bound": round(bound * share, 3), "steps": steps}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
