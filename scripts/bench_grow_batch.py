#!/usr/bin/env python
"""Growing many requests' trees at once: one pass per tree level for all of them
(grow_batch: llama.cpp decoding the requests' sequences in a context they share, or a
transformers minion's compact forward running every request's rows over its own cache)
against each request's tree grown in turn (what a batch did before). Reading the
requests' prompts is measured the same way (prefill_batch against prefill in turn).

    python scripts/bench_grow_batch.py                    # cpu-demo-disk's substitute, 8 requests
    python scripts/bench_grow_batch.py --requests 16 --profile cpu-demo
    python scripts/bench_grow_batch.py --profile stdlib-demo   # a transformers minion

Workload: the benchmark's chat prompts, read once; then, for each tree shape (nodes,
depth; greedy and drawn at T=0.7), `--reps` rounds of: every request's tree grown one
after another, then all of them in one grow_batch (the trees are dropped after each
grow, so every round grows from the same prompts). Prints the median milliseconds of
each and their ratio, and ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks.chat_prompts import chat_prompts  # noqa: E402
from benchmarks.choices import resolve_profile  # noqa: E402
from minions_local import Engine  # noqa: E402
from minions_local.core.protocols import GrowBudget  # noqa: E402
from minions_local.core.sampling import SamplingParams  # noqa: E402

SHAPES = [(1, 1), (2, 2), (4, 2), (8, 4)]
TEMPERATURE = 0.7


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="cpu-demo-disk")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--reps", type=int, default=6)
    return p.parse_args(argv)


def _minions(engine, requests: int, longest: int):
    """(the minion growing one request after another, the one growing them together,
    its kind): the profile's llama.cpp minion (two of them: the batch's shares contexts),
    else its first transformers minion (itself twice: its slots are its own either way)."""
    from minions_local.backends.gguf import GGUFMinion
    from minions_local.backends.hf_minion import HFMinion

    source = next((m for m in engine.minions if isinstance(m, GGUFMinion)), None)
    if source is not None:
        alone, shared = GGUFMinion(source.path, n_ctx=2048), GGUFMinion(source.path, n_ctx=2048)
        shared.share_passes(requests, longest)
        return alone, shared, "llama.cpp"
    hf = next((m for m in engine.minions if isinstance(m, HFMinion) and m.shares_passes), None)
    return (hf, hf, "transformers") if hf is not None else None


def _reads(alone, shared, slots, prompts, reps: int) -> dict:
    """Every prompt read in turn on fresh slots, against all of them in one prefill_batch."""
    turns, batched = [], []
    for _ in range(reps):
        for slot in slots:
            alone.drop_slot(slot)
        start = time.perf_counter()
        for slot, prompt in zip(slots, prompts):
            alone.use_slot(slot)
            alone.prefill(prompt)
        turns.append(time.perf_counter() - start)
        for slot in slots:  # (the same minion, for a transformers one)
            shared.drop_slot(slot)
        start = time.perf_counter()
        shared.prefill_batch(list(zip(slots, prompts)))
        batched.append(time.perf_counter() - start)
    one, together = statistics.median(turns) * 1e3, statistics.median(batched) * 1e3
    print(f"{len(prompts)} prompts ({sum(map(len, prompts))} tokens) read: one after another {one:6.1f} ms, "
          f"prefill_batch {together:6.1f} ms, x{one / together:.2f}", flush=True)
    return {"one_after_another_ms": round(one, 1), "prefill_batch_ms": round(together, 1),
            "ratio": round(one / together, 2)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine = Engine.from_profile(resolve_profile(args.profile, None))
    prompts = [p.ids for p in chat_prompts(engine.tokenizer, args.requests)]
    prompts = [prompts[i % len(prompts)] for i in range(args.requests)]
    vocab = engine.decoder.target.vocab_size
    picked = _minions(engine, args.requests, max(map(len, prompts)) + 128)  # the prompts and a reply each
    if picked is None:
        print(f"{args.profile} has no minion that grows a batch: nothing to measure", file=sys.stderr)
        return 1
    alone, shared, kind = picked
    slots = range(1, args.requests + 1)
    reads = _reads(alone, shared, slots, prompts, max(2, args.reps // 2))

    rows = []
    for nodes, depth in SHAPES:
        for drawn in (False, True):
            def budget() -> GrowBudget:
                if not drawn:
                    return GrowBudget(max_nodes=nodes, max_depth=depth, width=max(1, nodes // depth), top_k=8)
                return GrowBudget(max_nodes=nodes, max_depth=depth, width=max(1, nodes // depth), top_k=8,
                                  sampling=SamplingParams(TEMPERATURE, 1.0, 0),
                                  generator=torch.Generator().manual_seed(nodes), vocab_limit=vocab)

            turns, batched = [], []
            for _ in range(args.reps):
                requests = [(slot, prompt, budget()) for slot, prompt in zip(slots, prompts)]
                start = time.perf_counter()
                for slot, prompt, b in requests:
                    alone.use_slot(slot)
                    alone.grow(prompt, b)
                    alone.commit([])
                turns.append(time.perf_counter() - start)
                start = time.perf_counter()
                shared.grow_batch(requests)
                for slot, _, _ in requests:
                    shared.use_slot(slot)
                    shared.commit([])
                batched.append(time.perf_counter() - start)
            one, together = statistics.median(turns) * 1e3, statistics.median(batched) * 1e3
            rows.append({"nodes": nodes, "depth": depth, "drawn": drawn, "one_after_another_ms": round(one, 1),
                         "grow_batch_ms": round(together, 1), "ratio": round(one / together, 2)})
            print(f"{args.requests} requests, {nodes:>2} nodes, depth {depth}, {'drawn' if drawn else 'greedy'}: "
                  f"one after another {one:6.1f} ms, grow_batch {together:6.1f} ms, x{one / together:.2f}",
                  flush=True)
    for minion in {id(alone): alone, id(shared): shared}.values():
        getattr(minion, "close", lambda: None)()
    print(json.dumps({"profile": args.profile, "minion": kind, "requests": args.requests,
                      "threads": getattr(shared, "grow_threads", torch.get_num_threads()),
                      "prompt_reads": reads, "shapes": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
