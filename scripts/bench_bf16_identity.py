"""How often speculative greedy decoding differs from the target alone, per dtype.

In float32 a tree pass gives the same argmax as a 1-token pass, so the reply is
token-identical (the tests check it). In bfloat16 a batched pass rounded differently
from a 1-token pass (other matmul kernels, other summation order in attention), and
where the target's two best tokens nearly tie the argmax flipped: 1 of 8 replies
identical at the adaptive budget. The target is now row-invariant in bf16 (float64
attention, 1-token passes run as two rows: backends/compact.py), and this checks that
it holds on real chat replies, at the adaptive budget and at fixed tree sizes (larger
trees are larger batches). The reference is this engine with no minions, the same
target; transformers' own bf16 passes round otherwise again.

    python scripts/bench_bf16_identity.py [--profile cpu-demo] [--prompts 8] [--tokens 128]

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.chat_prompts import chat_prompts

from minions_local import Engine


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="cpu-demo")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--budgets", default="adaptive,16,64", help="comma-separated: adaptive or node counts")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    rows = []
    start = time.perf_counter()
    for dtype in args.dtypes.split(","):
        alone = Engine.from_profile(args.profile, dtype=dtype, minions=[], threads=args.threads)
        prompts = chat_prompts(alone.tokenizer, args.prompts)
        reference = []
        for p in prompts:
            alone.reset()
            reference.append(alone.generate(p.ids, max_new_tokens=args.tokens).token_ids)
        for budget in args.budgets.split(","):
            engine = Engine.from_profile(args.profile, dtype=dtype, threads=args.threads,
                                         budget=budget if budget == "adaptive" else int(budget))
            flips = []
            compared = 0
            for p, ref in zip(prompts, reference):
                engine.reset()
                out = engine.generate(p.ids, max_new_tokens=args.tokens).token_ids
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
    print(json.dumps({"profile": args.profile, "tokens": args.tokens, "seconds": round(time.perf_counter() - start),
                      "results": rows}))


if __name__ == "__main__":
    main()
