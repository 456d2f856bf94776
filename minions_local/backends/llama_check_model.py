"""A few layers of a GGUF model as a model of their own: what the load's exactness check
(llama_load.rows_differ) runs on when a file is new.

Why: the check reads a prompt of 80 rows with a tree below it, and again in pieces. On
the whole 8B-shaped Q4_K_M that was six passes and 10 of a first chat's 20 s of loading
(2-core EPYC, in RAM; more under a memory limit, where every pass streams the file).
What the check proves is a property of ggml's kernels, not of the weights' values: which
kernel a matrix product takes depends on its weight's type and shape and on the rows of
the pass, and the attention's on the heads, the cache and the rows. A model made of the
file's own bytes for every tensor outside the layers (embedding, head, norms) and of
the fewest layers that hold every (tensor, type, shape) the file's layers hold, with
the file's metadata (heads, context, tokenizer) and only the layer count changed, runs
every kernel the whole model runs, at the same shapes and rows, for a fraction of the
pass: two layers of 32 (~0.4 GB of 4.35) on the 8B.

The copy lives in memory (a memfd) for the check's few seconds and is never written to
disk (issue 36: no disk copy of the user's file). Where a model cannot be cut this way
(per-layer metadata arrays, layer patterns keyed by index: llama.cpp refuses the cut
model), the caller checks the whole model instead.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from minions_local.models.gguf_file import _ARRAY, _SCALARS, _STRING, MAGIC, SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_COPY_CHUNK = 16 << 20


def covering_layers(model: Any) -> list[int]:
    """The fewest layers (greedy, lowest first on ties) whose tensors hold every
    (tensor name within a layer, ggml type, shape) that the model's layers hold, in order."""
    kinds: dict[int, set[tuple[str, int, tuple[int, ...]]]] = {}
    for name, t in model.tensors.items():
        m = _LAYER.match(name)
        if m:
            kinds.setdefault(int(m[1]), set()).add((m[2], t.ggml_type, t.shape))
    missing = set().union(*kinds.values()) if kinds else set()
    chosen: list[int] = []
    while missing:
        best = max(sorted(kinds), key=lambda i: len(kinds[i] & missing))
        chosen.append(best)
        missing -= kinds[best]
    return sorted(chosen)


def _value_end(buf: memoryview, pos: int, kind: int) -> int:
    """Where a metadata value of type `kind` starting at `pos` ends."""
    if kind in _SCALARS:
        return pos + struct.calcsize(_SCALARS[kind])
    if kind == _STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if kind == _ARRAY:
        inner, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if inner in _SCALARS:
            return pos + count * struct.calcsize(_SCALARS[inner])
        for _ in range(count):
            pos = _value_end(buf, pos, inner)
        return pos
    raise ValueError(f"unknown metadata value type {kind}")


def _metadata_bytes(path: Path, block_key: str, layers: int) -> tuple[bytes, int]:
    """The file's metadata section as it is, with `block_key` set to `layers` and the
    split keys left out (the cut model is one file): (bytes, how many pairs)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            n_meta = struct.unpack_from("<Q", buf, 16)[0]
            pos, out, pairs = 24, bytearray(), 0
            for _ in range(n_meta):
                begin = pos
                n = struct.unpack_from("<Q", buf, pos)[0]
                key = bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8")
                kind = struct.unpack_from("<I", buf, pos + 8 + n)[0]
                value_at = pos + 12 + n
                pos = _value_end(buf, value_at, kind)
                if key in (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS):
                    continue
                pairs += 1
                if key == block_key:
                    out += bytes(buf[begin:value_at]) + struct.pack(_SCALARS[kind], layers)
                else:
                    out += bytes(buf[begin:pos])
            return bytes(out), pairs
        finally:
            buf.release()


def write_cut_model(model: Any, layers: list[int], out: Any) -> int:
    """Write to the binary file `out` a GGUF of `model` (gguf_file.GGUFModel) with only
    `layers` (renumbered 0, 1, ... in order) and every tensor outside the layers; returns
    its size. Tensor bytes are copied from the model's files as they are."""
    first = model.files[0]
    keep: list[tuple[str, Any, Path]] = []  # (name in the cut model, tensor, its file)
    renumber = {old: new for new, old in enumerate(layers)}
    for f in model.files:
        for name, t in f.tensors.items():
            m = _LAYER.match(name)
            if m is None:
                keep.append((name, t, f.path))
            elif int(m[1]) in renumber:
                keep.append((f"blk.{renumber[int(m[1])]}.{m[2]}", t, f.path))
    if any(t.nbytes is None for _, t, _ in keep):
        raise ValueError("a tensor of a type this reader cannot size")
    alignment = first.metadata.get("general.alignment", 32)
    meta, pairs = _metadata_bytes(first.path, f"{first.architecture}.block_count", len(layers))
    infos, offset, offsets = bytearray(), 0, []
    for name, t, _ in keep:
        encoded = name.encode("utf-8")
        infos += struct.pack("<Q", len(encoded)) + encoded + struct.pack("<I", len(t.shape))
        infos += struct.pack(f"<{len(t.shape)}Q", *reversed(t.shape))
        infos += struct.pack("<IQ", t.ggml_type, offset)
        offsets.append(offset)
        offset = -(-(offset + t.nbytes) // alignment) * alignment
    header = MAGIC + struct.pack("<IQQ", first.version, len(keep), pairs) + meta + bytes(infos)
    out.write(header + bytes(-len(header) % alignment))
    data_start = len(header) + (-len(header) % alignment)
    handles: dict[Path, Any] = {}
    try:
        for (name, t, path), at in zip(keep, offsets):
            src = handles.get(path) or handles.setdefault(path, open(path, "rb"))
            out.seek(data_start + at)
            src.seek(t.offset)
            left = t.nbytes
            while left:
                chunk = src.read(min(left, _COPY_CHUNK))
                if not chunk:
                    raise ValueError(f"{path} ends inside tensor {name}")
                out.write(chunk)
                left -= len(chunk)
    finally:
        for h in handles.values():
            h.close()
    out.truncate(data_start + offset)
    return data_start + offset


@contextlib.contextmanager
def cut_model_path(model: Any, layers: list[int]) -> Iterator[Path]:
    """A path to the cut model (write_cut_model) for the block's span: a file in memory
    where the OS has them (Linux's memfd), else a temporary file, removed at the end."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("minions-check-model", 0)
        try:
            with os.fdopen(os.dup(fd), "w+b") as out:
                write_cut_model(model, layers, out)
            yield Path(f"/proc/{os.getpid()}/fd/{fd}")
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="minions-check-") as tmp:
        path = Path(tmp) / "check.gguf"
        with open(path, "w+b") as out:
            write_cut_model(model, layers, out)
        yield path
