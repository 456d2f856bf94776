"""Resident what fits, stream the rest: the page cache under a llama.cpp target's file,
steered layer by layer.

llama.cpp maps the GGUF file and computes on the mapping (weights are never copied:
repacking is off for the exact target), so the page cache *is* its layer store. Left to
itself under a memory limit, the kernel evicts whatever it likes and every pass faults
the file back in 4-16 KiB at a time. Here instead:
  - the resident layers are locked in memory (mlock, where the process may);
  - the streamed layers are read ahead, in the order the pass needs them, by a thread of
    their own (posix_fadvise WILLNEED starts a layer's reads, up to the device's readahead
    size, then MADV_POPULATE_READ reads the rest and maps the pages, so the pass meets no
    page fault; queuing the whole layer in small 512 KB WILLNEED pieces was slower),
    at most `window` layers ahead of the layer being computed;
  - a streamed layer is dropped once computed (MADV_DONTNEED unmaps it, POSIX_FADV_DONTNEED
    takes it out of the page cache), so the resident layers never compete with it;
  - when a pass ends, the first streamed layers of the next are read while the minions
    grow its tree.

Where the pass stands comes from llama.cpp itself: the context's eval callback
(`cb_eval`) is asked about every graph node before it runs, and a node's name ends in
its layer ("attn_norm-12"). Asking to stop at each layer's first node splits the graph
there (a thread barrier per layer; the logits are the same bits, checked in the tests),
and there the streamer waits until that layer is in memory, so a pass never runs ahead
of its reads. The data always comes from the file's own pages: a late read costs time,
never correctness.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_DONTNEED, MADV_POPULATE_READ = 4, 22
_LAYER = re.compile(rb"-(\d+)$")


@dataclass(frozen=True)
class Span:
    """Bytes [start, end) of one file."""

    file: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def layer_spans(files: Sequence[Any], layers: int) -> list[list[Span]]:
    """Per decoder layer, the byte ranges of its tensors (`blk.N.*`) in the parsed GGUF
    files (models/gguf_file.py; several for a split model), merged where they touch."""
    spans: list[list[Span]] = [[] for _ in range(layers)]
    for index, file in enumerate(files):
        for name, t in file.tensors.items():
            if not name.startswith("blk."):
                continue
            layer = int(name.split(".")[1])
            if layer < layers and t.nbytes:
                spans[layer].append(Span(index, t.offset, t.offset + t.nbytes))
    merged = []
    for parts in spans:
        out: list[Span] = []
        for s in sorted(parts, key=lambda s: (s.file, s.start)):
            if out and out[-1].file == s.file and s.start <= out[-1].end + PAGE:
                out[-1] = Span(s.file, out[-1].start, max(out[-1].end, s.end))
            else:
                out.append(s)
        merged.append(out)
    return merged


def advise(fd: int, start: int, size: int, advice: int) -> None:
    """posix_fadvise as a hint: a file system that refuses it (the reads then come from the
    faults themselves) must not end the thread that asks, which a pass may be waiting on."""
    try:
        os.posix_fadvise(fd, start, size, advice)
    except OSError:
        pass


def resident_spans(files: Sequence[Any], spans: list[list[Span]], resident: set[int]) -> list[Span]:
    """What a pass reads that does not stream: the resident layers' spans, and every byte
    of the files outside the layers (the embedding, the head, the norms), in file order."""
    layered = sorted((s for parts in spans for s in parts), key=lambda s: (s.file, s.start))
    out = [s for layer in sorted(resident) for s in spans[layer]]
    for index, file in enumerate(files):
        at = 0
        for s in (s for s in layered if s.file == index):
            if s.start > at:
                out.append(Span(index, at, s.start))
            at = max(at, s.end)
        if file.size > at:
            out.append(Span(index, at, file.size))
    return sorted(out, key=lambda s: (s.file, s.start))


class FileReadAhead:
    """Reads byte ranges of files into the page cache on a thread of its own, from the
    start of a load: the reads then overlap the work before llama.cpp maps the file (the
    exactness check on a cut, ~1.5 s) and, held in RAM, its load's own copy of the Q4_K
    matrices (llama.cpp repacks a tensor as soon as its pages are in). `stop()` ends it
    between chunks (a failed load reads no further).

    Plain sequential reads, a chunk at a time into one scratch buffer: the kernel's own
    readahead keeps the device busy ahead of each. Measured on the 8B-shaped Q4_K_M in
    RAM (2-core AVX-512 EPYC, 0.9 GB/s reads, the load started 1.5 s after the reads):
    5.0-6.1 s to a loaded target, against 7.4-9.7 with the chunks queued as 512 KB
    WILLNEED pieces and mapped in by MADV_POPULATE_READ (the reader's queue and
    llama.cpp's own populate of the file fought over the device), and 7.9-12.4 s with no
    reads ahead (llama.cpp reads the file, then copies it, one after the other)."""

    CHUNK = 8 << 20
    """Bytes a read asks: the device's readahead size (read_ahead_kb) on the boxes
    measured; larger gained nothing, and `stop()` waits at most one."""

    def __init__(self, paths: Sequence[Path], ranges: Sequence[Span]) -> None:
        self._paths = [Path(p) for p in paths]
        self._ranges = list(ranges)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="target-file-reads", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fds: dict[int, int] = {}
        read = _read_to_null()
        try:
            for span in self._ranges:
                if span.file not in fds:
                    fds[span.file] = os.open(self._paths[span.file], os.O_RDONLY)
                whole = span.start == 0 and span.end >= os.fstat(fds[span.file]).st_size
                for a in range(span.start, span.end, self.CHUNK):
                    if self._stop.is_set():
                        return
                    if read(fds[span.file], a, min(self.CHUNK, span.end - a), splice=whole) <= 0:
                        break  # the file is shorter than it was: llama.cpp's own read says so
        except OSError:
            return  # a hint, not a load: llama.cpp's own read reports the file's faults
        finally:
            read.close()
            for fd in fds.values():
                os.close(fd)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every range was read (or the reads ended) within `timeout` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _read_to_null:
    """read(fd, offset, count, splice): `count` bytes of the file at `offset` into the page
    cache, waited for, and how many there were. With `splice`, sent to /dev/null (sendfile)
    where the kernel can: the pages are read and never copied. Copying them out cost a
    core: on the 2-core EPYC VM a buffered read of the 8B-shaped Q4_K_M (4.35 GB) spent 8.6
    s of system time (6.4 s with the file already cached, the copy alone), its sendfile
    0.2 s, while the load's own threads and the imports waited for the CPU. But a splice
    moves 64 KB at a time, and the kernel's readahead around it read more than the range
    asked: spliced, the resident spans of a streamed model (a test's 8-layer file) brought
    a streamed layer next to them into memory, which plain reads of the same spans did
    not. So only a whole file is spliced (one held in RAM), not the resident layers of a
    streamed model, whose neighbours are to stay out. Else, and where the kernel refuses
    the splice: plain reads into one scratch buffer."""

    def __init__(self) -> None:
        self._null: int | None = os.open(os.devnull, os.O_WRONLY) if hasattr(os, "sendfile") else None
        self._buffer: memoryview | None = None

    def __call__(self, fd: int, offset: int, count: int, *, splice: bool) -> int:
        if splice and self._null is not None:
            try:
                return os.sendfile(self._null, fd, offset, count)
            except OSError:  # no splice from this file system: read it as below
                os.close(self._null)
                self._null = None
        if self._buffer is None or len(self._buffer) < count:
            self._buffer = memoryview(bytearray(count))
        return os.preadv(fd, [self._buffer[:count]], offset)

    def close(self) -> None:
        if self._null is not None:
            os.close(self._null)
            self._null = None


_early_readers: dict[tuple[str, ...], FileReadAhead] = {}
"""Readers of whole files started before their load (planning/target_read_ahead.py), by path."""
_early_lock = threading.Lock()


def read_files_ahead(paths: Sequence[Path]) -> None:
    """Read these whole files into the page cache on a thread of their own, from now, for a
    load to come (claim_read_ahead); one reader a set of files, however often asked."""
    key = tuple(str(Path(p).resolve()) for p in paths)
    with _early_lock:
        if key not in _early_readers:
            sizes = [os.stat(p).st_size for p in key]
            _early_readers[key] = FileReadAhead([Path(p) for p in key], [Span(i, 0, n) for i, n in enumerate(sizes)])


def claim_read_ahead(paths: Sequence[Path]) -> FileReadAhead | None:
    """The reader read_files_ahead started for these files (the load's now: it stops it), or None."""
    with _early_lock:
        return _early_readers.pop(tuple(str(Path(p).resolve()) for p in paths), None)


def find_mappings(paths: Sequence[Path]) -> list[int | None]:
    """For each file, the address its byte 0 would have in this process's mapping of it
    (llama.cpp maps a GGUF from its first data page: address - offset), read from
    /proc/self/maps; None where it is not mapped."""
    wanted = {str(Path(p).resolve()): i for i, p in enumerate(paths)}
    found: list[int | None] = [None] * len(paths)
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            i = wanted.get(parts[5].strip())
            if i is not None and found[i] is None:
                found[i] = int(parts[0].split("-")[0], 16) - int(parts[2], 16)
    return found


class _Libc:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL(None, use_errno=True)
        for name in ("madvise", "mlock", "munlock"):
            fn = getattr(self.lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + ([ctypes.c_int] if name == "madvise" else [])
            fn.restype = ctypes.c_int


class PageCacheStreamer:
    """Keeps `resident` layers in memory and streams the others through the page cache,
    `window` layers ahead of the pass (see the module). `files` are the parsed GGUF
    files the target maps; attach it to a context with `callback` (cb_eval)."""

    def __init__(self, paths: Sequence[Path], spans: list[list[Span]], resident: set[int], window: int = 2,
                 ggml_get_name: Any = None) -> None:
        self.paths = [Path(p) for p in paths]
        self.spans = spans
        self.resident = set(resident)
        self.streamed = [i for i in range(len(spans)) if i not in self.resident]
        self.window = max(1, window)
        self.bytes_streamed = 0
        self.seconds_waiting = 0.0
        """Time passes spent waiting for a layer's reads (what the reads did not hide)."""
        self.locked = 0
        """Bytes of resident layers locked in memory (0 where mlock is not allowed)."""
        self._libc = _Libc()
        self._name = ggml_get_name
        self._fds = [os.open(p, os.O_RDONLY) for p in self.paths]
        self._bases: list[int | None] = [None] * len(self.paths)
        self._cond = threading.Condition()
        self._loaded: set[int] = set()
        self._next = 0  # index into `streamed` of the next layer the pass needs
        self._stop = False
        self._layer = -1  # the layer whose first node the pass last reached
        self._thread: threading.Thread | None = None

    # --- setting up --------------------------------------------------------------------

    def attach(self) -> bool:
        """Find llama.cpp's mappings of the files, lock the resident layers and start
        reading; False where a file is not mapped (llama.cpp loaded without mmap)."""
        self._bases = find_mappings(self.paths)
        if any(b is None for b in self._bases):
            return False
        for layer in sorted(self.resident):
            for span in self.spans[layer]:
                addr, size = self._inner(span)
                if size and self._libc.lib.mlock(addr, size) == 0:
                    self.locked += size
        if self.streamed:
            self._thread = threading.Thread(target=self._read_ahead, name="target-layer-reads", daemon=True)
            self._thread.start()
        return True

    def _addr(self, span: Span) -> tuple[int, int]:
        """The span in the mapping, widened to whole pages (for reading)."""
        start = span.start // PAGE * PAGE
        end = -(-span.end // PAGE) * PAGE
        return self._bases[span.file] + start, end - start

    def _inner(self, span: Span) -> tuple[int, int]:
        """The whole pages inside the span (for dropping: a page shared with a neighbour
        that stays resident is left alone)."""
        start = -(-span.start // PAGE) * PAGE
        end = span.end // PAGE * PAGE
        return self._bases[span.file] + start, max(0, end - start)

    # --- the pass -------------------------------------------------------------------------

    def on_node(self, tensor: Any, ask: bool) -> bool:
        """cb_eval: asked about each node before it runs. At a layer's first node, stop
        there (so the graph splits), wait for that layer's reads, and drop the streamed
        layer before the previous one (fully computed by then)."""
        if not ask:
            return True
        match = _LAYER.search(self._name(tensor) or b"")
        if match is None:
            return False
        layer = int(match.group(1))
        if layer == self._layer:
            return False
        self._layer = layer
        self._reach(layer)
        return True

    def _reach(self, layer: int) -> None:
        with self._cond:
            self._next = next((k for k, i in enumerate(self.streamed) if i >= layer), len(self.streamed))
            wanted = set(self._wanted())  # (with few streamed layers, the next pass's may wrap around)
            dropping = [i for i in self._loaded if i <= layer - 2 and i not in wanted]
            self._loaded.difference_update(dropping)
            self._cond.notify_all()
        for i in dropping:
            self._drop(i)
        if layer in self.resident or layer >= len(self.spans):
            return
        start = time.perf_counter()
        with self._cond:
            while layer not in self._loaded and not self._stop:
                self._cond.wait(0.5)
        self.seconds_waiting += time.perf_counter() - start

    def decode_done(self) -> None:
        """A llama_decode ended: its last streamed layers are dropped, and the next one's
        first streamed layers are read now (while the minions grow the next tree)."""
        with self._cond:
            self._layer = -1
            self._next = 0
            keep = set(self._wanted())
            dropping = [i for i in self._loaded if i not in keep]
            self._loaded.difference_update(dropping)
            self._cond.notify_all()
        for i in dropping:
            self._drop(i)

    def _wanted(self) -> list[int]:
        """The streamed layers to have in memory now, in the order the pass needs them."""
        order = self.streamed[self._next:] + self.streamed[:self._next]
        return order[:self.window + 1]

    def _read_ahead(self) -> None:
        while True:
            with self._cond:
                while not self._stop:
                    todo = [i for i in self._wanted() if i not in self._loaded]
                    if todo:
                        break
                    self._cond.wait()
                if self._stop:
                    return
                layer = todo[0]
            self._read(layer)
            with self._cond:
                self._loaded.add(layer)
                self._cond.notify_all()

    def _read(self, layer: int) -> None:
        for span in self.spans[layer]:
            advise(self._fds[span.file], span.start, span.size, os.POSIX_FADV_WILLNEED)
        for span in self.spans[layer]:
            addr, size = self._addr(span)
            self._libc.lib.madvise(addr, size, MADV_POPULATE_READ)
            self.bytes_streamed += span.size

    def _drop(self, layer: int) -> None:
        for span in self.spans[layer]:
            addr, size = self._inner(span)
            if size:
                self._libc.lib.madvise(addr, size, MADV_DONTNEED)
                advise(self._fds[span.file], addr - self._bases[span.file], size, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
