"""How fast does the target stream, and what does a pass cost by tree size?

    python scripts/bench_stream.py [--quick] [--model PATH] [--dtype bfloat16] [--quant int4]
    python scripts/bench_stream.py --synthetic llama-70b --device cuda   # GPU box: no checkpoint needed

In one run:
1. raw: sequential O_DIRECT read of the disk tier's pack files (page cache bypassed,
   nothing overlapped), by 1 thread and by as many threads as the streamer uses; the
   better of the two is the yardstick;
2. achieved: bytes streamed / wall time over back-to-back full target passes from the
   disk tier (tree size 1, compute overlapped with the reads, pipeline starting empty);
   stream_efficiency = achieved / raw. Short rounds alternate the three (order rotating)
   so that other processes' disk traffic hits all alike; the ratio is of totals;
3. pass time for tree sizes 1, 2, 4, ..., 256: resident vs RAM tier vs disk tier,
   interleaved per size, each target wrapped as the engine wraps it (the compact
   forward where it is bit-exact), and the disk tier through transformers' forward.

Prints a human table, then ONE JSON line. The default model is the demo target
(minions_local/demo_models/target) when present, otherwise a random Llama built here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minions_local.backends.hf_target import HFTarget, exact_target  # noqa: E402
from minions_local.offload import load_streamed_causal_lm  # noqa: E402
from minions_local.offload.checkpoint import Checkpoint  # noqa: E402
from benchmarks.raw_reads import read_files_direct  # noqa: E402
from minions_local.offload.layout import aligned_empty  # noqa: E402
from minions_local.offload.streamed import layer_store, resolve_dtype  # noqa: E402

DEMO_TARGET = REPO / "minions_local" / "demo_models" / "target"
PREFIX = 64


def random_llama(folder: Path, quick: bool) -> Path:
    """A random Llama (~70M params; ~20M with --quick) saved as safetensors."""
    config = LlamaConfig(vocab_size=8000, hidden_size=768 if not quick else 512,
                         intermediate_size=2048 if not quick else 1408, num_hidden_layers=8 if not quick else 6,
                         num_attention_heads=12 if not quick else 8, num_key_value_heads=4,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def tree(size: int, rng: random.Random) -> list[int]:
    """Parents of a random bushy tree: node 0 is the root, others hang below earlier nodes."""
    return [-1] + [rng.randrange(max(0, i - 6), i) for i in range(1, size)]


class Runner:
    """One target, wrapped as the engine wraps it, with a fixed prefix in its cache;
    `pass_(size)` times one tree pass."""

    def __init__(self, name: str, target, stats, device: str) -> None:
        self.name, self.target, self.stats, self.device = name, target, stats, device
        self.vocab = target.model.config.vocab_size
        self.rng = random.Random(0)
        prefix = torch.randint(0, self.vocab, (PREFIX,), generator=torch.Generator().manual_seed(0))
        target.extend(prefix.tolist())

    def pass_(self, size: int) -> float:
        parents = tree(size, self.rng)
        tokens = [self.rng.randrange(self.vocab) for _ in parents]
        anc, depth = ancestors(parents)
        t0 = time.perf_counter()
        self.target.forward(tokens, anc, depth, PREFIX)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.target.truncate(PREFIX)  # back to the fixed prefix
        return dt

    def store(self):
        return layer_store(self.target.model)


def ancestors(parents: list[int]) -> tuple[np.ndarray, list[int]]:
    """(visibility [T, T]: node i sees j when j is i or an ancestor of i, depth per node)."""
    t = len(parents)
    anc = np.zeros((t, t), dtype=bool)
    depth: list[int] = []
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return anc, depth


def checkpoint_params(folder: Path) -> int:
    ckpt = Checkpoint(folder)
    return sum(math.prod(ckpt.shape(name)) for name in ckpt.names())


def streamed_gbps(runner: Runner, passes: int) -> tuple[float, float]:
    """(GB/s achieved, seconds waiting per pass) over back-to-back tree-size-1 passes."""
    n, t, w = streamed_run(runner, passes)
    return n / t / 1e9, w / passes


def streamed_run(runner: Runner, passes: int) -> tuple[int, float, float]:
    """(bytes streamed, seconds, seconds waiting) of back-to-back tree-size-1 passes.

    The pipeline starts empty (nothing prefetched before the clock starts), so the
    figure includes one pipeline fill: pessimistic by ~1 layer's read per `passes`.
    """
    runner.store().drain()
    b0, w0 = runner.stats.bytes_streamed, runner.stats.seconds_waiting
    t0 = time.perf_counter()
    for _ in range(passes):
        runner.pass_(1)
    dt = time.perf_counter() - t0
    # The next pass's first layers are in flight now: their reads count neither here
    # (pessimistic) nor against whatever is measured next.
    runner.store().drain()
    return runner.stats.bytes_streamed - b0, dt, runner.stats.seconds_waiting - w0


def h2d_check(ram: Runner, passes: int, rounds: int) -> dict:
    """CUDA: the RAM tier's achieved pinned-host -> GPU speed vs a plain pinned memcpy's."""
    layer = ram.stats.bytes_per_pass // max(1, ram.stats.layers_streamed // max(1, ram.stats.passes))
    host = aligned_empty(layer, pin=True)
    devbuf = torch.empty(layer, dtype=torch.uint8, device=ram.device)
    peaks, achieved = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(passes):
            devbuf.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        peaks.append(layer * passes / (time.perf_counter() - t0) / 1e9)
        achieved.append(streamed_gbps(ram, passes)[0])
    peak, got = statistics.median(peaks), statistics.median(achieved)
    return {"h2d_peak_gbps": round(peak, 2), "h2d_achieved_gbps": round(got, 2), "h2d_efficiency": round(got / peak, 3)}


def pass_times(runners: list[Runner], sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Median seconds per pass by tree size; the methods interleaved, so load hits all alike."""
    times: dict[str, dict[int, float]] = {r.name: {} for r in runners}
    for size in sizes:
        samples: dict[str, list[float]] = {r.name: [] for r in runners}
        for r in runners:
            r.pass_(size)  # warm this shape
        for _ in range(repeats):
            for r in runners:
                samples[r.name].append(r.pass_(size))
        for name, xs in samples.items():
            times[name][size] = statistics.median(xs)
    return times


def synthetic(args, passes: int, rounds: int, repeats: int, sizes: list[int]) -> None:
    """A random-weight target of a real shape, streamed from (pinned) RAM: the pass-time
    curve a profile depends on, and on CUDA the RAM tier's copy speed vs memcpy peak."""
    from benchmarks.synthetic import synthetic_streamed_causal_lm

    dtype = resolve_dtype(args.dtype or "bfloat16", Path("."))
    quant = args.quant or "int4"
    model, stats = synthetic_streamed_causal_lm(args.synthetic, layers=args.layers, quant=quant, dtype=dtype,
                                                device=args.device, buffers=args.buffers, readers=args.readers)
    ram = Runner("ram", exact_target(model, bytes_streamed=lambda: stats.bytes_streamed), stats, args.device)
    ram.pass_(1)
    h2d = h2d_check(ram, passes, rounds) if args.device.startswith("cuda") else {}
    times = pass_times([ram], sizes, repeats)
    result = {
        "bench": "stream-synthetic",
        "shape": args.synthetic,
        "layers": len(model.model.layers),
        "dtype": str(dtype).removeprefix("torch."),
        "quant": quant,
        "buffers": args.buffers,
        "bytes_per_pass": stats.bytes_per_pass,
        **h2d,
        "pass_ms": {"ram": {str(k): round(v * 1e3, 2) for k, v in times["ram"].items()}},
        "device": args.device if not args.device.startswith("cuda") else torch.cuda.get_device_name(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    print(f"synthetic {args.synthetic}: {result['layers']} layers, {quant}, {dtype}, "
          f"{stats.bytes_per_pass / 1e9:.2f} GB streamed per pass from RAM to {result['device']}")
    if h2d:
        print(f"pinned RAM -> GPU: peak {h2d['h2d_peak_gbps']} GB/s, achieved {h2d['h2d_achieved_gbps']} GB/s, "
              f"efficiency {h2d['h2d_efficiency']}")
    print(f"{'tree size':>9} {'ms/pass':>10}")
    for size in sizes:
        print(f"{size:>9} {result['pass_ms']['ram'][str(size)]:>10.2f}")
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and repeats (~1 min)")
    ap.add_argument("--model", type=Path, default=None, help="HF model folder (default: the demo target)")
    ap.add_argument("--dtype", default=None, help="compute dtype (default: the checkpoint's)")
    ap.add_argument("--quant", default=None, choices=["none", "int8", "int4"],
                    help="streamed-layer storage (default: none; int4 with --synthetic)")
    ap.add_argument("--buffers", type=int, default=6,
                    help="layer buffers (read-ahead depth); 6 keeps the demo target's reads from pausing")
    ap.add_argument("--cache-dir", type=Path, default=None, help="where the disk tier's packs go (default: a temp dir)")
    ap.add_argument("--device", default="cpu", help="compute device: cpu or cuda (adds the pinned-RAM -> GPU check)")
    ap.add_argument("--readers", type=int, default=None, help="disk-tier reader threads (default: max(2, buffers))")
    ap.add_argument("--synthetic", default=None, choices=["llama-70b", "llama-8b", "demo"],
                    help="time a random-weight target of this shape streamed from RAM (no checkpoint, no disk)")
    ap.add_argument("--layers", type=int, default=None, help="with --synthetic: decoder layers (default: the shape's)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 1 on a busy or 2-core machine, else torch's default)")
    args = ap.parse_args()
    args.readers = args.readers or max(2, args.buffers)
    if args.synthetic is None:
        args.quant = args.quant or "none"
    cores = os.cpu_count() or 1
    busy = os.getloadavg()[0] >= cores / 2
    # 2-thread torch on cores another process uses runs 5-25x slower (PLATFORM_FACTS.md),
    # and load comes and goes during a run: on a small or busy box, one thread.
    torch.set_num_threads(args.threads or (1 if busy or cores <= 2 else torch.get_num_threads()))
    rounds, passes, repeats = (12, 4, 3) if args.quick else (24, 4, 5)
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    if args.synthetic:
        return synthetic(args, passes, rounds, repeats, sizes)
    work = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    try:
        model_path = args.model or (DEMO_TARGET if (DEMO_TARGET / "config.json").exists() else None)
        source = str(model_path) if model_path else "random llama (built here)"
        if model_path is None:
            model_path = random_llama(work / "model", args.quick)
        dtype = resolve_dtype(args.dtype, model_path)
        cache_dir = args.cache_dir or work / "packs"
        dev = args.device
        common = dict(device=dev, dtype=dtype, quant=args.quant, buffers=args.buffers, cache_dir=cache_dir,
                      readers=args.readers)

        # Each target wrapped as the engine wraps it (the compact forward where it is
        # exact), plus the disk tier through transformers' own forward for comparison.
        if args.quant == "none":
            resident_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
            resident = exact_target(resident_model.to(dev).eval())
        else:  # the same quantized weights, resident: the device tier
            resident = exact_target(load_streamed_causal_lm(model_path, tier="device", **common)[0])
        ram_model, ram_stats = load_streamed_causal_lm(model_path, tier="ram", **common)
        disk_model, disk_stats = load_streamed_causal_lm(model_path, tier="disk", **common)
        hf_model, hf_stats = load_streamed_causal_lm(model_path, tier="disk", **common)
        ram_target = exact_target(ram_model, bytes_streamed=lambda: ram_stats.bytes_streamed)
        disk_target = exact_target(disk_model, bytes_streamed=lambda: disk_stats.bytes_streamed)
        runners = [Runner("resident", resident, None, dev),
                   Runner("ram", ram_target, ram_stats, dev),
                   Runner("disk", disk_target, disk_stats, dev),
                   Runner("disk_transformers", HFTarget(hf_model), hf_stats, dev)]
        disk = runners[2]
        params = checkpoint_params(model_path)
        packs = sorted(Path(cache_dir).rglob("layer_*.pack"))
        one = [aligned_empty(16 << 20)]
        many = [aligned_empty(16 << 20) for _ in range(max(1, args.readers))]
        landing = [aligned_empty(max(p.stat().st_size for p in packs)) for _ in range(disk.store().k)]

        # 1 + 2: raw vs achieved, alternated in short rounds (order rotating) so that
        # other processes' disk traffic hits all alike; totals, not medians. "ring" is
        # not a yardstick: the raw reads landing in K layer-sized buffers in turn, as the
        # pipeline's must, with no compute; it splits the efficiency into what the
        # platform charges for landing K layers (ring / raw) and what overlapping them
        # with compute costs (achieved / ring).
        for r in runners:
            r.pass_(1)  # warm up kernels; also the disk pipeline's first read + checksum
        chunk = packs * passes  # the bytes one stream round moves
        kinds = ("seq", "par", "ring", "stream")
        secs = {k: 0.0 for k in kinds}
        moved = {k: 0 for k in kinds}
        ratios, waits = [], []
        for i in range(rounds):
            this: dict[str, float] = {}
            for what in kinds[i % len(kinds):] + kinds[: i % len(kinds)]:
                if what == "stream":
                    n, t, w = streamed_run(disk, passes)
                    waits.append(w / passes)
                else:
                    t0 = time.perf_counter()
                    n = read_files_direct(chunk, one if what == "seq" else many,
                                          landing=landing if what == "ring" else None)
                    t = time.perf_counter() - t0
                secs[what] += t
                moved[what] += n
                this[what] = n / t
            ratios.append(this["stream"] / max(this["seq"], this["par"]))
        gbps = {k: moved[k] / secs[k] / 1e9 for k in secs}
        yardstick = max(gbps["seq"], gbps["par"])

        h2d = h2d_check(runners[1], passes, rounds) if dev.startswith("cuda") else {}

        times = pass_times(runners, sizes, repeats)

        result = {
            "bench": "stream",
            "model": source,
            "params": params,
            "dtype": str(dtype).removeprefix("torch."),
            "quant": args.quant,
            "buffers": args.buffers,
            "torch_threads": torch.get_num_threads(),
            "bytes_per_pass": disk_stats.bytes_per_pass,
            "read_mode": disk_stats.read_mode,
            "readers": args.readers,
            "rounds": rounds,
            "raw_read_gbps": round(yardstick, 3),
            "raw_sequential_gbps": round(gbps["seq"], 3),
            "raw_parallel_gbps": round(gbps["par"], 3),
            "achieved_gbps": round(gbps["stream"], 3),
            "stream_efficiency": round(gbps["stream"] / yardstick, 3),
            "landing_buffers": disk.store().k,
            "landing_read_gbps": round(gbps["ring"], 3),
            "landing_ceiling": round(gbps["ring"] / yardstick, 3),
            "overlap_efficiency": round(gbps["stream"] / gbps["ring"], 3),
            "stream_efficiency_round_quartiles": [round(q, 3) for q in statistics.quantiles(ratios, n=4)],
            "wait_ms_per_pass": round(1e3 * statistics.median(waits), 2),
            "stream_pass_ms": round(1e3 * disk_stats.bytes_per_pass / 1e9 / gbps["stream"], 2),
            # share of a pass's read time (at the raw speed) that compute did not wait for
            "read_hidden_fraction": round(max(0.0, 1 - statistics.median(waits)
                                              / (disk_stats.bytes_per_pass / 1e9 / yardstick)), 3),
            # read-bound when compute waited on reads for a real share of the pass; a
            # compute-bound pass says nothing about the streaming (efficiency < 1 by design)
            "bound": "read" if statistics.median(waits) * gbps["stream"] * 1e9
                     > 0.2 * disk_stats.bytes_per_pass else "compute",
            "pass_ms": {name: {str(k): round(v * 1e3, 2) for k, v in t.items()} for name, t in times.items()},
            **h2d,
            "device": dev if not dev.startswith("cuda") else torch.cuda.get_device_name(),
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "warnings": disk_stats.warnings + ram_stats.warnings,
        }
        print_table(result, sizes)
        print(json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_table(res: dict, sizes: list[int]) -> None:
    print(f"model: {res['model']}  ({res['params'] / 1e6:.1f}M params, {res['dtype']}, quant={res['quant']}, "
          f"{res['bytes_per_pass'] / 1e6:.1f} MB streamed per pass, read mode {res['read_mode']})")
    print(f"raw O_DIRECT read   {res['raw_read_gbps']:6.3f} GB/s  (the better of 1 thread "
          f"{res['raw_sequential_gbps']} and {res['readers']} threads {res['raw_parallel_gbps']})")
    print(f"achieved, disk tier {res['achieved_gbps']:6.3f} GB/s  "
          f"({res['rounds']} rounds alternating with the raw reads)")
    print(f"raw reads landing in {res['landing_buffers']} layer buffers in turn {res['landing_read_gbps']:.3f} GB/s: "
          f"landing ceiling {res['landing_ceiling']:.3f} of raw, the pipeline achieves "
          f"{res['overlap_efficiency']:.3f} of that")
    print(f"stream efficiency   {res['stream_efficiency']:6.3f}       (per-round quartiles "
          f"{res['stream_efficiency_round_quartiles']}; passes are {res['bound']}-bound, "
          f"{res['stream_pass_ms']} ms each)")
    if "h2d_peak_gbps" in res:
        print(f"pinned RAM -> GPU     peak {res['h2d_peak_gbps']} GB/s, RAM tier achieved {res['h2d_achieved_gbps']} "
              f"GB/s, efficiency {res['h2d_efficiency']}")
    print(f"compute waited on reads {res['wait_ms_per_pass']} ms per pass ({res['read_hidden_fraction']:.0%} of the "
          f"read time hidden behind compute); load average {res['loadavg_1m']} "
          f"on {os.cpu_count()} cores (shared machines make every number noisy)")
    print()
    names = list(res["pass_ms"])
    print(f"{'tree size':>9} " + " ".join(f"{n + ' ms':>{max(12, len(n) + 3)}}" for n in names)
          + f" {'disk/resident':>14}")
    for s in sizes:
        row = [res["pass_ms"][n][str(s)] for n in names]
        disk = res["pass_ms"]["disk"][str(s)]
        print(f"{s:>9} " + " ".join(f"{x:>{max(12, len(n) + 3)}.2f}" for n, x in zip(names, row))
              + f" {disk / row[0]:>14.2f}")


if __name__ == "__main__":
    main()
