#!/usr/bin/env python
"""Does growing ahead pay? Pipelined drafting, measured on and off in one run.

Minions and SPIN pipeline draft and verify: while the target verifies step t, the
minions already draft step t+1. Here a llama.cpp minion keeps growing step t's tree
below its leaves during the verification, and when the target's bonus token lands on
a node it grew, step t+1 starts from the subtree below it (speculation/ahead.py).
This runs two engines of one profile, growing ahead forced on and off, on the chat
benchmark's prompts, alternating prompt by prompt, and reports the speed of each, how
often a step started from a carried subtree, and what the target's pass cost.

    python scripts/bench_pipelining.py [--profile cpu-demo-disk] [--prompts 6] [--max-new 128]

Prints one line per mode and setting and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.chat_prompts import chat_prompts

from minions_local import Engine
from minions_local.core.events import StepEvent


def run(engine: Engine, ids: list[int], max_new: int, temperature: float) -> tuple[float, list]:
    start = time.perf_counter()
    records = [e.record for e in engine.stream(ids, max_new_tokens=max_new, temperature=temperature)
               if isinstance(e, StepEvent)]
    return time.perf_counter() - start, records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu-demo-disk")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=128)
    args = ap.parse_args()
    engines = {ahead: Engine.from_profile(args.profile, grow_ahead=ahead) for ahead in (False, True)}
    carriers = [m for m in engines[True].decoder.minions if m.grows_ahead]
    if not carriers:
        raise SystemExit(f"no minion of profile {args.profile} can grow ahead (llama.cpp minions can)")
    prompts = chat_prompts(engines[True].tokenizer, args.prompts + 1)
    for engine in engines.values():  # warm-up, on a prompt not measured
        engine.generate(prompts[-1].ids, max_new_tokens=32)
    result = {"bench": "pipelining", "profile": args.profile, "prompts": args.prompts, "max_new": args.max_new}
    for mode, temperature in (("greedy", 0.0), ("sampled", 0.7)):
        totals = {ahead: [0.0, []] for ahead in engines}
        carried_before = sum(m.carries for m in carriers)
        for prompt in prompts[:-1]:
            for ahead, engine in engines.items():
                seconds, records = run(engine, prompt.ids, args.max_new, temperature)
                totals[ahead][0] += seconds
                totals[ahead][1] += records
        carried = sum(m.carries for m in carriers) - carried_before
        result[mode] = {}
        for ahead, (seconds, records) in totals.items():
            tokens = sum(r.new_tokens for r in records)
            row = {"tokens_per_s": round(tokens / seconds, 2), "tokens_per_pass": round(tokens / len(records), 2),
                   "grow_ms": round(1e3 * statistics.mean(r.t_grow for r in records), 1),
                   "verify_ms": round(1e3 * statistics.mean(r.t_verify for r in records), 1),
                   "tree": round(statistics.mean(r.tree_size for r in records), 1),
                   "ahead_nodes": round(statistics.mean(r.ahead_nodes for r in records), 1)}
            if ahead:
                row["carried_steps"] = round(carried / len(records), 3)
            result[mode]["ahead" if ahead else "plain"] = row
            print(f"{mode:8s} growing ahead {'on ' if ahead else 'off'}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
        on, off = result[mode]["ahead"], result[mode]["plain"]
        result[mode]["ahead_vs_plain"] = round(on["tokens_per_s"] / off["tokens_per_s"], 3)
        print(f"{mode:8s} growing ahead: {result[mode]['ahead_vs_plain']:.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
