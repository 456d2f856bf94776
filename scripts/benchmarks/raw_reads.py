"""The raw-speed yardstick of the benchmarks: whole files read with O_DIRECT.

Nothing else runs while it reads, so it says what the disk gives; bench_stream.py
divides the layer pipeline's achieved speed by it (stream efficiency), and bench.py
turns it into the physical bound of a disk-tier method (tokens per pass x raw read
bandwidth / bytes read per pass).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

from minions_local.offload.disk import READ_CHUNK, open_direct
from minions_local.offload.layout import BLOCK, aligned_empty, round_up


def read_files_direct(paths: list[Path], buffers: list[torch.Tensor], *,
                      landing: list[torch.Tensor] | None = None) -> int:
    """Read whole files with O_DIRECT (page cache bypassed), nothing else running; returns bytes.

    The raw-speed yardstick of the streaming benchmark. Each file is split into
    len(buffers) block-aligned ranges, the way `LayerStore` splits a layer, and
    len(buffers) threads take the ranges in file order from one queue (no barrier
    between files), each into its own buffer. One buffer = a plain sequential read.

    landing: file k lands whole in landing[k % len(landing)] (each at least a file
    long) instead of each thread re-reading into its own scratch: the memory traffic
    of a streamer that keeps len(landing) layers in memory, with no compute.
    """
    fds = [open_direct(p) for p in paths]
    try:
        ranges = []
        for k, fd in enumerate(fds):
            size = os.fstat(fd).st_size // BLOCK * BLOCK
            step = round_up(-(-size // len(buffers)), BLOCK)
            for start in range(0, size, step):
                stop = min(size, start + step)
                for a in range(start, stop, READ_CHUNK):  # bounded by the buffer size
                    ranges.append((k, fd, a, min(stop, a + READ_CHUNK)))
        queue = iter(ranges)
        lock = threading.Lock()
        total = [0] * len(buffers)

        def worker(i: int) -> None:
            view = memoryview(buffers[i].numpy())
            while True:
                with lock:
                    item = next(queue, None)
                if item is None:
                    return
                k, fd, a, b = item
                dest = view[: b - a] if landing is None else memoryview(landing[k % len(landing)][a:b].numpy())
                total[i] += os.preadv(fd, [dest], a)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(buffers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(total)
    finally:
        for fd in fds:
            os.close(fd)


def stream_pack_files(model) -> tuple[list[Path], int]:
    """The layer pack files a disk-tier model streams, in pass order ([] when none), and
    how many reader threads its pipeline reads them with."""
    from minions_local.offload.binding import layer_store

    store = layer_store(model)
    if store is None:
        return [], 1
    return [s.reader.pack.path for s in store.sources if getattr(s, "tier", "") == "disk"], store.readers


def raw_read_gbps(paths: list[Path], readers: int) -> float:
    """GB/s of one O_DIRECT read of `paths`: the better of one sequential reader and
    `readers` parallel ones (the disk tier reads a layer as that many range reads)."""
    best = 0.0
    for count in sorted({1, max(1, readers)}):
        buffers = [aligned_empty(READ_CHUNK) for _ in range(count)]
        start = time.perf_counter()
        moved = read_files_direct(paths, buffers)
        seconds = time.perf_counter() - start
        best = max(best, moved / seconds / 1e9 if seconds > 0 else 0.0)
    return best
