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
disk (issue 36: no disk copy of the user's file); only where the OS has no memfd (not
Linux) is it a temporary file, removed after the check. Where a model cannot be cut this way
(per-layer metadata arrays, layer patterns keyed by index: llama.cpp refuses the cut
model), the caller checks the whole model instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from minions_local.models.gguf_file import _SCALARS, MAGIC, SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS

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


def pass_bytes_ratio(model: Any, layers: list[int]) -> float:
    """Weight bytes a 1-token pass of the model reads over those of its cut of `layers`:
    every matrix but the embedding (a pass looks up its few rows), which is read whole
    where it is also the head (no output.weight). The cut's passes (the same kernels on
    the same shapes) times this are the model's: on the 8B-shaped Q4_K_M in RAM (2-core
    EPYC) this is 9.95 where the model's passes of 1, 5 and 25 rows took 10.2-10.6x the
    cut's. It replaces timing the model itself, whose first passes on a new file pay
    one-time costs (0.76 and 0.35 s against 0.19 later, on that VM): the cost model's
    estimate was 1.8x the real pass until its first refit."""
    tied = "output.weight" not in model.tensors
    keep = set(layers)

    def total(names: Any) -> int:
        return sum(model.tensors[n].nbytes or 0 for n in names
                   if len(model.tensors[n].shape) >= 2 and (n != "token_embd.weight" or tied))

    whole = total(model.tensors)
    cut = total(n for n in model.tensors if not (m := _LAYER.match(n)) or int(m[1]) in keep)
    return whole / cut if cut else 1.0


def _metadata_bytes(file: Any, block_key: str, layers: int) -> tuple[bytes, int]:
    """The file's metadata pairs as they are (gguf_file.GGUFFile.metadata_spans), with
    `block_key`'s value set to `layers` and the split keys left out (the cut model is one
    file): (bytes, how many pairs)."""
    spans = {k: v for k, v in file.metadata_spans.items() if k not in (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS)}
    first = min(start for start, _, _ in file.metadata_spans.values())
    last = max(end for _, _, end in file.metadata_spans.values())
    with open(file.path, "rb") as f:
        f.seek(first)
        raw = f.read(last - first)
    out = bytearray()
    for key, (start, value_start, end) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        if key == block_key:
            kind = struct.unpack_from("<I", raw, value_start - 4 - first)[0]
            out += raw[start - first:value_start - first] + struct.pack(_SCALARS[kind], layers)
        else:
            out += raw[start - first:end - first]
    return bytes(out), len(spans)


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
    meta, pairs = _metadata_bytes(first, f"{first.architecture}.block_count", len(layers))
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
    # Copied through Python's buffers, not by sendfile: a splice of the file's last tensors
    # made the kernel's readahead bring the streamed layer before them into memory (a
    # streamed load's test), as the reader's splices did (llama_stream._read_to_null).
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
