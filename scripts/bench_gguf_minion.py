#!/usr/bin/env python
"""Grow time of one minion as a GGUF (llama.cpp) vs as an HF model (transformers).

    python scripts/bench_gguf_minion.py MINION_HF_DIR [--type q8_0] [--nodes 32 --depth 6 --width 8]

Exports the minion to a temporary GGUF, then replays the same decoding-like sequence
of contexts on both backends (each step appends a 2-token "accepted" path plus a bonus
token, so both reuse their caches the way the engine makes them), interleaving the two
so that noise from other processes on the machine hits both alike. Reports the median
grow time of each and their ratio. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from minions_local.backends.gguf import GGUFMinion
from minions_local.backends.gguf_export import export_gguf
from minions_local.backends.hf import load_causal_lm, resolve_dtype
from minions_local.backends.hf_minion import HFMinion
from minions_local.core.protocols import GrowBudget


def prompt_ids(src: Path, n: int) -> list[int]:
    from transformers import AutoTokenizer

    text = inspect.getsource(statistics)  # text every machine has
    return AutoTokenizer.from_pretrained(src)(text, add_special_tokens=False)["input_ids"][:n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="HF minion folder (with tokenizer.json)")
    parser.add_argument("--type", default="q8_0", choices=["f32", "f16", "q8_0", "q4_0"])
    parser.add_argument("--hf-dtype", default="bfloat16", help="dtype of the HF minion (bf16 is fastest on CPU)")
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="threads for BOTH backends (default: torch's)")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = args.threads or torch.get_num_threads()
    budget = GrowBudget(max_nodes=args.nodes, max_depth=args.depth, width=args.width, top_k=args.top_k)
    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = export_gguf(args.src, Path(tmp) / f"minion-{args.type}.gguf", type=args.type)
        backends = {
            "gguf": GGUFMinion(gguf_path, n_threads=threads, n_ctx=max(1024, args.prompt + 4 * args.steps + 512)),
            "hf": HFMinion(load_causal_lm(args.src, "minion", resolve_dtype(args.hf_dtype), "cpu"), name="hf"),
        }
        context = prompt_ids(args.src, args.prompt)
        times: dict[str, list[float]] = {name: [] for name in backends}
        sizes: dict[str, list[int]] = {name: [] for name in backends}
        for step in range(args.steps + 1):
            trees = {}
            order = list(backends.items()) if step % 2 == 0 else list(backends.items())[::-1]
            for name, minion in order:
                start = time.perf_counter()
                trees[name] = minion.grow(context, budget)
                if step:  # step 0 is the prompt prefill: reported separately
                    times[name].append(time.perf_counter() - start)
                    sizes[name].append(len(trees[name]))
            accepted = trees["hf"].tokens[:1] + [context[(step * 7) % len(context)]]
            for minion in backends.values():
                minion.commit(accepted)
            context = context + accepted

    med = {name: statistics.median(t) * 1000 for name, t in times.items()}
    print(f"minion {args.src.name}: budget {args.nodes} nodes, depth {args.depth}, width {args.width}; "
          f"{threads} thread(s); {args.steps} steps, interleaved")
    print(f"{'backend':<22}{'median ms':>10}{'min ms':>9}{'nodes':>7}")
    for name in backends:
        label = f"gguf {args.type} (llama.cpp)" if name == "gguf" else f"hf {args.hf_dtype} (torch)"
        print(f"{label:<22}{med[name]:>10.2f}{min(times[name]) * 1000:>9.2f}{statistics.mean(sizes[name]):>7.1f}")
    ratio = med["hf"] / med["gguf"]
    print(f"GGUF grows {ratio:.2f}x faster than HF (median ratio; shared CPUs make absolute times noisy)")
    print(json.dumps({"minion": args.src.name, "type": args.type, "hf_dtype": args.hf_dtype, "nodes": args.nodes,
                      "depth": args.depth, "width": args.width, "threads": threads,
                      "gguf_ms": round(med["gguf"], 3), "hf_ms": round(med["hf"], 3), "speedup": round(ratio, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
