"""bench_stream.py's measuring (and gpu_check's curve's): targets timed pass by pass,
bytes streamed over wall time, and the table.

Every figure comes from short interleaved runs (shared machines make each noisy)."""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.stream_bound import StreamBound, stream_bound
from minions_local.offload.binding import layer_store
from minions_local.offload.checkpoint import Checkpoint

PREFIX = 64


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


def engine_pass_bound(engine, raw_gbps: float, passes: int = 8) -> StreamBound | None:
    """Which bound an engine's own 1-token target passes are under (None: its target
    does not stream): back-to-back passes timed as bench_stream.py times them, counted
    by the target's layer store. The engine's cache is reset before and after."""
    target = engine.decoder.target
    stats = getattr(target, "stream_stats", None)
    if stats is None or layer_store(target.model) is None:
        return None
    engine.reset()
    try:
        runner = Runner("autoregressive", target, stats, next(target.model.parameters()).device.type)
        runner.pass_(1)  # the first pass fills the pipeline and warms the kernels
        moved, seconds, waiting = streamed_run(runner, passes)
    finally:
        engine.reset()
    return stream_bound(bytes_per_pass=moved / passes, seconds_per_pass=seconds / passes,
                        waiting_per_pass=waiting / passes, raw_gbps=raw_gbps)


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


def print_table(res: dict, sizes: list[int], bound: str) -> None:
    """`bound`: StreamBound.describe(), the line that says which figure holds."""
    print(f"model: {res['model']}  ({res['params'] / 1e6:.1f}M params, {res['dtype']} computed in "
          f"{res['compute_dtype']}, quant={res['quant']}, {res['bytes_per_pass'] / 1e6:.1f} MB streamed per pass, "
          f"read mode {res['read_mode']})")
    print(f"raw O_DIRECT read   {res['raw_read_gbps']:6.3f} GB/s  (the better of 1 thread "
          f"{res['raw_sequential_gbps']} and {res['readers']} threads {res['raw_parallel_gbps']})")
    print(f"achieved, disk tier {res['achieved_gbps']:6.3f} GB/s  "
          f"({res['rounds']} rounds alternating with the raw reads)")
    print(f"raw reads landing in {res['landing_buffers']} layer buffers in turn {res['landing_read_gbps']:.3f} GB/s: "
          f"landing ceiling {res['landing_ceiling']:.3f} of raw, the pipeline achieves "
          f"{res['overlap_efficiency']:.3f} of that")
    print(f"passes are {bound}")
    print(f"                    ({res['stream_pass_ms']} ms a pass; per-round achieved/raw quartiles "
          f"{res['stream_efficiency_round_quartiles']})")
    print(f"compute waited on reads {res['wait_ms_per_pass']} ms per pass; load average {res['loadavg_1m']} "
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
