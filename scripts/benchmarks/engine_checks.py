"""Our engine against itself, no peers: bench.py's modes that measure one property of it.

    python scripts/bench.py identity [--profile cpu-demo] [--prompts 8] [--tokens 128]
    python scripts/bench.py growing-ahead [--profile cpu-demo-disk] [--prompts 6] [--max-new 128]
    python scripts/bench.py acceptance [--tokens 64] [--prompts 3]

identity: how often speculative greedy replies differ from the same engine's with no
minions, per dtype and tree budget. In float32 a tree pass gives the same argmax as a
1-token pass, so the reply is token-identical (the tests check it). In bfloat16 a
batched pass rounded differently from a 1-token pass (other matmul kernels, other
summation order in attention), and where the target's two best tokens nearly tie the
argmax flipped: 1 of 8 replies identical at the adaptive budget. The target is now
row-invariant in bf16 (float64 attention, 1-token passes run as two rows:
backends/compact.py); this checks that it holds on real chat replies, at the adaptive
budget and at fixed tree sizes (larger trees are larger batches). The reference is the
same target; transformers' own bf16 passes round otherwise again.

growing-ahead: does pipelined drafting pay? While the target verifies step t, a
llama.cpp minion keeps growing step t's tree below its leaves, and when the target's
bonus token lands on a node it grew, step t+1 starts from the subtree below it
(speculation/ahead.py). Two engines of one profile, growing ahead forced on and off,
alternate prompt by prompt; it reports the speed of each, how often a step started from
a carried subtree, and what the target's pass cost.

acceptance: accepted draft tokens per target pass on the stdlib family (one shared
target, engines that differ only in minions and budget, held-out prompts), greedy and
at T=0.7: `seeded` keeps fixed drafts and SpecExec's rule so that a seed repeats
exactly, `sampled` draws the drafts and verifies by recursive rejection sampling.

Each prints a line per setting and ends with one JSON line (bench.py prints it).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.chat_prompts import chat_prompts

def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def identity(args: argparse.Namespace) -> dict:
    from minions_local import Engine

    rows = []
    for dtype in args.dtypes.split(","):
        alone = Engine.from_profile(args.profile, dtype=dtype, minions=[], threads=args.threads)
        prompts = chat_prompts(alone.tokenizer, args.prompts)
        reference = _greedy_replies(alone, prompts, args.tokens)
        for budget in args.budgets.split(","):
            engine = Engine.from_profile(args.profile, dtype=dtype, threads=args.threads,
                                         budget=budget if budget == "adaptive" else int(budget))
            flips, compared = [], 0
            for p, ref, out in zip(prompts, reference, _greedy_replies(engine, prompts, args.tokens)):
                at = first_difference(out, ref)
                compared += len(ref) if at is None else at + 1
                if at is not None:
                    flips.append({"prompt": p.source, "token": at})
            rows.append({"dtype": dtype, "budget": budget, "replies": len(prompts),
                         "identical": len(prompts) - len(flips), "tokens_compared": compared,
                         "flips_per_1k_tokens": round(1000 * len(flips) / max(compared, 1), 2),
                         "first_differences": flips})
            print(f"{dtype:9s} budget {budget:>8s}: {len(prompts) - len(flips)}/{len(prompts)} replies identical; "
                  f"first differences at {[f['token'] for f in flips] or 'none'}", flush=True)
    return {"profile": args.profile, "tokens": args.tokens, "results": rows}


def _greedy_replies(engine, prompts, tokens: int) -> list[list[int]]:
    replies = []
    for p in prompts:
        engine.reset()
        replies.append(engine.generate(p.ids, max_new_tokens=tokens).token_ids)
    return replies


def growing_ahead(args: argparse.Namespace) -> dict:
    from minions_local import Engine
    from minions_local.core.events import StepEvent

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
                start = time.perf_counter()
                totals[ahead][1] += [e.record for e in engine.stream(prompt.ids, max_new_tokens=args.max_new,
                                                                     temperature=temperature)
                                     if isinstance(e, StepEvent)]
                totals[ahead][0] += time.perf_counter() - start
        carried = sum(m.carries for m in carriers) - carried_before
        result[mode] = {}
        for ahead, (seconds, records) in totals.items():
            tokens = sum(r.new_tokens for r in records)
            mean = lambda field, scale=1: round(scale * statistics.mean(getattr(r, field) for r in records), 1)  # noqa: E731
            row = {"tokens_per_s": round(tokens / seconds, 2), "tokens_per_pass": round(tokens / len(records), 2),
                   "grow_ms": mean("t_grow", 1e3), "verify_ms": mean("t_verify", 1e3),
                   "tree": mean("tree_size"), "ahead_nodes": mean("ahead_nodes")}
            if ahead:
                row["carried_steps"] = round(carried / len(records), 3)
            result[mode]["ahead" if ahead else "plain"] = row
            print(f"{mode:8s} growing ahead {'on ' if ahead else 'off'}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
        on, off = result[mode]["ahead"], result[mode]["plain"]
        result[mode]["ahead_vs_plain"] = round(on["tokens_per_s"] / off["tokens_per_s"], 3)
        print(f"{mode:8s} growing ahead: {result[mode]['ahead_vs_plain']:.2f}x")
    return result


def acceptance(args: argparse.Namespace) -> dict:
    """Measured (2026-11-21; T=0.7, 3 prompts x 64 tokens), accepted draft tokens a pass:
      one minion, 8 nodes        seeded 0.59   sampled 2.49
      all minions, 8 nodes       seeded 0.56   sampled 2.05
      all minions, 32 nodes      seeded 0.73   sampled 3.09
    Greedy (T=0): 1.29 / 1.78 / 2.69."""
    import torch

    from benchmarks.methods import engine_sharing_target
    from benchmarks.prompts import held_out_prompts
    from minions_local.engine import Engine
    from minions_local.speculation.budget import FixedBudget

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
                steps = []
                for i, p in enumerate(prompts):
                    random.seed(i)  # unseeded requests draw their drafts: this keeps them repeatable
                    gen = engine.generate(p.ids, max_new_tokens=args.tokens, temperature=t, seed=i if seeded else None)
                    steps += [s.accepted for s in gen.steps]
                row[f"{regime} T={t:g}"] = round(sum(steps) / len(steps), 3)
                print(f"{label:28s} {regime:8s} T={t:.1f}  accepted/step {sum(steps) / len(steps):.2f}", flush=True)
    return result


def add_parsers(modes) -> None:
    p = modes.add_parser("identity", help="speculative greedy replies against the target alone, per dtype")
    p.add_argument("--profile", default="cpu-demo")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--budgets", default="adaptive,16,64", help="comma-separated: adaptive or node counts")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(measure=identity)
    p = modes.add_parser("growing-ahead", help="growing ahead during verification, on against off")
    p.add_argument("--profile", default="cpu-demo-disk")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new", type=int, default=128)
    p.set_defaults(measure=growing_ahead)
    p = modes.add_parser("acceptance", help="accepted draft tokens per pass on the stdlib family")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--temperatures", default="0.0,0.7")
    p.set_defaults(measure=acceptance)
