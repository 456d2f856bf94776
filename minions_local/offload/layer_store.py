"""Where streamed layers live, and the prefetch pipeline that brings them to compute.

`LayerStore` owns K compute-side buffers. Before streamed layer j runs, `acquire(j)`
waits for its fetch; when it has run, `release(j)` starts the fetch K layers ahead into
the buffer it gave back; so while one layer computes, the next K-1 are in flight. The
sequence wraps around: while the last layers of a pass compute, the first layers of
the next pass are already being read, overlapping the lm_head, sampling and the
minions' work.

Fetching, by tier and device:

| source | CPU compute                               | CUDA compute                                    |
|--------|-------------------------------------------|-------------------------------------------------|
| ram    | reader thread: memcpy into the buffer     | pinned RAM -> device on a copy stream + events  |
| disk   | reader thread: O_DIRECT read into buffer  | reader thread: O_DIRECT into a pinned staging   |
|        |                                           | buffer, then a copy-stream copy to the device   |

On CPU the RAM tier is as fast as resident weights would be; the copy is kept so the
pipeline (and what it costs) is the same one a GPU box runs.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from minions_local.offload.disk import PackReader
from minions_local.offload.layout import LayerLayout, aligned_empty

MEMCPY_CHUNK = 64 << 20


@dataclass
class StreamStats:
    """Counters the engine reads around each target pass (diff `bytes_streamed` per pass)."""

    bytes_streamed: int = 0
    """Cumulative weight bytes brought to the compute side for streamed layers."""
    seconds_waiting: float = 0.0
    """Cumulative seconds the compute side waited for a layer that was not there yet
    (host side; on CUDA the copy-stream waits are asynchronous and not counted)."""
    layers_streamed: int = 0
    passes: int = 0
    bytes_per_pass: int = 0
    """Bytes one full pass streams (all streamed layers), fixed at load time."""
    read_mode: str = ""
    """How the disk tier reads: 'o_direct', 'fadvise' (page cache dropped after reads), or ''."""
    warnings: list[str] = field(default_factory=list)
    """Fallbacks taken at load time (also sent to logging.warning)."""
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    """Load-time fact: bytes the streamed layers keep in each tier ('ram': packed in host
    memory, 'disk': pack files), and 'device': the compute-side layer buffers they
    stream into. Resident weights are the target's own count (its weight_bytes)."""

    def reset(self) -> None:
        """Zero the counters (not the load-time facts or warnings)."""
        self.bytes_streamed = 0
        self.seconds_waiting = 0.0
        self.layers_streamed = 0
        self.passes = 0


class _Fetch:
    """One layer's fetch: several futures, then a check run once on the compute side."""

    def __init__(self, futures: list[Future], finish: Callable[[], None] | None = None) -> None:
        self.futures = futures
        self.finish = finish

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self) -> None:
        for f in self.futures:
            f.result()
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()


class RamSource:
    """A packed layer held in host RAM (pinned when the compute device is CUDA)."""

    tier = "ram"

    def __init__(self, layout: LayerLayout, data: torch.Tensor) -> None:
        self.layout = layout
        self.data = data

    def read_into(self, buffer: torch.Tensor) -> None:
        n = self.layout.nbytes
        dst, src = buffer.data_ptr(), self.data.data_ptr()
        # ctypes releases the GIL and stays on one core, so compute keeps the others.
        for off in range(0, n, MEMCPY_CHUNK):
            ctypes.memmove(dst + off, src + off, min(MEMCPY_CHUNK, n - off))

    def close(self) -> None:
        pass


class DiskSource:
    """A packed layer in a pack file, read with O_DIRECT."""

    tier = "disk"

    def __init__(self, layout: LayerLayout, reader: PackReader) -> None:
        self.layout = layout
        self.reader = reader

    def read_into(self, buffer: torch.Tensor) -> None:
        self.reader.read_into(buffer)

    def submit(self, pool: ThreadPoolExecutor, buffer: torch.Tensor, ways: int) -> _Fetch:
        """Read the layer as `ways` concurrent range reads, so the disk keeps queued
        requests while a reader that just finished waits to be scheduled again."""
        futures = [pool.submit(self.reader.read_part, buffer, a, b) for a, b in self.reader.parts(ways)]
        return _Fetch(futures, lambda: self.reader.check(buffer))

    def close(self) -> None:
        self.reader.close()


LayerSource = RamSource | DiskSource


class LayerStore:
    """K compute-side buffers fed by a prefetch pipeline over the streamed layers."""

    def __init__(self, sources: Sequence[LayerSource], *, device: torch.device, buffers: int, stats: StreamStats,
                 readers: int = 1) -> None:
        if buffers < 1:
            raise ValueError("buffers must be at least 1")
        self.sources = list(sources)
        self.device = device
        self.k = min(buffers, max(1, len(self.sources)))
        self.stats = stats
        size = max((s.layout.padded_nbytes for s in self.sources), default=0)
        self.cuda = device.type == "cuda"
        self.buffers = [aligned_empty(size, device=device) for _ in range(self.k)]
        self._staging: list[torch.Tensor] = []
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=device)
            self.ready = [torch.cuda.Event() for _ in range(self.k)]
            self.released = [torch.cuda.Event() for _ in range(self.k)]
            if any(s.tier == "disk" for s in self.sources):
                self._staging = [aligned_empty(size, pin=True) for _ in range(self.k)]
        self.readers = max(1, readers)
        self.parts = self.readers
        """Range reads per disk layer."""
        self._pool = ThreadPoolExecutor(max_workers=self.readers, thread_name_prefix="layer-reader")
        self._pending: dict[int, _Fetch] = {}
        self._seq = 0
        """Number of the next fetch to be consumed."""
        self._fetched = 0
        """Number of the next fetch to be submitted."""

    def __len__(self) -> int:
        return len(self.sources)

    # -- the pipeline -------------------------------------------------------------
    # Fetches are numbered m = 0, 1, 2, ... across passes: fetch m brings layer m % n
    # into buffer m % K. Numbering across passes lets the readers run on into the next
    # pass while the last layers, the lm_head and the caller's own work run.

    def begin_pass(self) -> None:
        """Called before the first layer of a forward pass."""
        if self._seq % len(self.sources) != 0:  # the previous pass stopped midway
            self.drain()
        self.stats.passes += 1

    def acquire(self, j: int) -> int:
        """Wait until streamed layer j is in a buffer; returns the buffer's index.

        On CUDA the wait is queued on the current stream, not done on the host."""
        if self._seq % len(self.sources) != j:  # out of the expected order: start over at j
            self.drain()
            self._seq = self._fetched = j
        m = self._seq
        self._submit_until(m + self.k)
        fetch = self._pending.pop(m, None) or self._submit(m)  # None: an earlier failure was consumed
        if not fetch.done():
            t0 = time.perf_counter()
            fetch.result()
            self.stats.seconds_waiting += time.perf_counter() - t0
        else:
            fetch.result()
        k = m % self.k
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[k])
        self.stats.bytes_streamed += self.sources[j].layout.nbytes
        self.stats.layers_streamed += 1
        return k

    def release(self, j: int) -> None:
        """Layer j finished computing (on CUDA: is queued): its buffer may be refilled."""
        if self.cuda:
            self.released[self._seq % self.k].record(torch.cuda.current_stream(self.device))
        self._seq += 1
        self._submit_until(self._seq + self.k)

    def _submit_until(self, stop: int) -> None:
        while self._fetched < stop:
            self._pending[self._fetched] = self._submit(self._fetched)
            self._fetched += 1

    def _submit(self, m: int) -> _Fetch:
        source, k = self.sources[m % len(self.sources)], m % self.k
        if not self.cuda:
            if isinstance(source, DiskSource):
                return source.submit(self._pool, self.buffers[k], self.parts)
            return _Fetch([self._pool.submit(source.read_into, self.buffers[k])])
        if source.tier == "ram":  # enqueueing an async copy is cheap: no thread needed
            self._copy_to_device(source.data, k, source.layout.padded_nbytes)
            return _Fetch([])
        return _Fetch([self._pool.submit(self._disk_to_device, source, k)])

    def _disk_to_device(self, source: DiskSource, k: int) -> None:
        self.ready[k].synchronize()  # the last copy out of this staging buffer is done
        staging = self._staging[k]
        source.read_into(staging)
        self._copy_to_device(staging, k, source.layout.padded_nbytes)

    def _copy_to_device(self, host: torch.Tensor, k: int, n: int) -> None:
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.released[k])
            self.buffers[k][:n].copy_(host[:n], non_blocking=True)
            self.ready[k].record(self.copy_stream)

    def drain(self) -> None:
        """Wait for the fetches in flight, then forget them: the pipeline starts empty."""
        for fut in self._pending.values():
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - a failed prefetch is re-raised when re-fetched
                pass
        self._pending.clear()
        self._seq = self._fetched = 0

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)
        for s in self.sources:
            s.close()
