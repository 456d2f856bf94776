"""Reading a GGUF file's header: its metadata and where each tensor's bytes lie.

GGUF (llama.cpp's format, version 2 and 3), little-endian::

    "GGUF"  u32 version  u64 tensor_count  u64 metadata_count
    metadata_count x  (string key, u32 value type, value)
    tensor_count   x  (string name, u32 n_dims, u64 dims[n_dims] (innermost first), u32 ggml type, u64 offset)
    padding to `general.alignment` (default 32), then the tensor data; each
    tensor's offset is relative to that data start.

A string is a u64 length and UTF-8 bytes; an array is a u32 element type, a u64 count
and the elements. Only this header is parsed here (no numpy, no weights read), so
opening a 40 GB file costs the size of its vocabulary. Every defect the parser can see
(a truncated file, a bad magic or version, a tensor past the end of the file) is a
ModelLoadError that names the file.

A large model usually comes split (llama.cpp's gguf-split): PREFIX-00001-of-00003.gguf
holds all the metadata and some tensors, each later shard more tensors, and every shard
says where it stands (`split.no`, `split.count`, `split.tensors.count`). `read_model`
reads them all as one model from any one of its shards.
"""

from __future__ import annotations

import os
import re
import struct
from functools import cached_property, lru_cache
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minions_local.core.errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}
"""ggml's tensor types: id -> (name, weights per block, bytes per block), as ggml.h and
gguf-py's GGML_QUANT_SIZES define them (a test compares the two). Every type is sized,
so a tensor of a type we cannot dequantize is still placed and named in the error."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of the file: its ggml type, its shape in torch order (rows first) and its bytes."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    """Absolute byte offset in the file."""
    nbytes: int | None
    """Bytes of the stored tensor; None for a type whose block size this reader does not know."""

    @property
    def type_name(self) -> str:
        known = GGML_TYPES.get(self.ggml_type)
        return known[0] if known else f"ggml type {self.ggml_type}"


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF header: metadata by key, tensors by name (in file order)."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int
    size: int
    metadata_spans: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """Per metadata key, where its pair lies in the file: (start, value start, end), so
    that a pair can be copied as it is (llama_check_model.py writes a cut of the file)."""

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path} names no model architecture (general.architecture); it is not a "
                                 f"model GGUF llama.cpp could load either. Re-export it.")
        return arch

    def arch_value(self, key: str, default: Any = None) -> Any:
        """The architecture's own metadata key, e.g. 'block_count' -> 'llama.block_count'."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def fingerprint(self) -> str:
        """Changes when the file changes (its size and modification time): what caches key on."""
        st = self.path.stat()
        return f"{st.st_size}:{st.st_mtime_ns}"


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, f, path: Path, size: int) -> None:
        self.f, self.path, self.size = f, path, size

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) < n:
            raise _damaged(self.path, "the file ends inside its header (truncated)")
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` length-prefixed UTF-8 strings, with no Python call per string: a
        vocabulary's tokens and merges are ~100k (an 8B's header: 0.047 s, against
        0.07-0.09 read a call at a time)."""
        read, out = self.f.read, []
        try:
            for _ in range(count):
                head = read(8)
                if len(head) < 8:
                    raise _damaged(self.path, "the file ends inside its header (truncated)")
                n = _U64.unpack(head)[0]
                if n > self.size:
                    raise _damaged(self.path, f"a string of {n} bytes in the header is longer than the file")
                data = read(n)
                if len(data) < n:
                    raise _damaged(self.path, "the file ends inside its header (truncated)")
                out.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            raise _damaged(self.path, "a header string is not UTF-8") from None
        return out

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = self.scalar("<I"), self.scalar("<Q")
            if count > self.size:
                raise _damaged(self.path, f"an array of {count} items in the header is longer than the file")
            if inner in _SCALARS:  # one read for the whole array (a vocabulary's scores, say)
                fmt = _SCALARS[inner]
                return list(struct.unpack(f"<{count}{fmt[1]}", self.take(count * struct.calcsize(fmt))))
            if inner == _STRING:
                return self.strings(count)
            return [self.value(inner) for _ in range(count)]
        raise _damaged(self.path, f"unknown metadata value type {kind}")


def _damaged(path: Path, what: str) -> ModelLoadError:
    return ModelLoadError(f"{path} is not a readable GGUF file: {what}. Re-download or re-export it (a copy "
                          f"or download that stopped early leaves a truncated file).")


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse the header of the GGUF file at `path` (ModelLoadError for any defect)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"The GGUF file {path} does not exist. Check the path.")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            cur = _Cursor(f, path, size)
            if cur.take(4) != MAGIC:
                raise _damaged(path, "it does not start with the GGUF magic bytes")
            version = cur.scalar("<I")
            if version not in VERSIONS:
                raise ModelLoadError(f"{path} is GGUF version {version}; versions {VERSIONS} are supported. "
                                     f"Re-export it with a current llama.cpp (convert_hf_to_gguf.py).")
            n_tensors, n_meta = cur.scalar("<Q"), cur.scalar("<Q")
            if n_tensors > size or n_meta > size:
                raise _damaged(path, "the header's counts are larger than the file")
            metadata, spans = {}, {}
            for _ in range(n_meta):
                start = f.tell()
                key = cur.string()
                kind = cur.scalar("<I")
                value_start = f.tell()
                metadata[key] = cur.value(kind)
                spans[key] = (start, value_start, f.tell())
            raw = []
            for _ in range(n_tensors):
                name = cur.string()
                n_dims = cur.scalar("<I")
                if n_dims > 8:
                    raise _damaged(path, f"tensor {name} claims {n_dims} dimensions")
                dims = [cur.scalar("<Q") for _ in range(n_dims)]
                raw.append((name, cur.scalar("<I"), tuple(reversed(dims)), cur.scalar("<Q")))
            header_end = f.tell()
    except OSError as e:
        raise ModelLoadError(f"Cannot read the GGUF file {path}: {e.strerror or e}. Check the disk and "
                             f"permissions.") from None
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise _damaged(path, f"general.alignment is {alignment!r}")
    data_offset = -(-header_end // alignment) * alignment
    tensors = {}
    for name, kind, shape, offset in raw:
        nbytes = None
        if kind in GGML_TYPES:
            type_name, block, type_size = GGML_TYPES[kind]
            if shape and shape[-1] % block:
                raise _damaged(path, f"tensor {name} has rows of {shape[-1]} weights, not a multiple of its "
                                     f"{type_name} blocks of {block}")
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel // block * type_size
            if data_offset + offset + nbytes > size:
                raise _damaged(path, f"tensor {name} lies past the end of the file ({size} bytes; truncated)")
        tensors[name] = TensorInfo(name, kind, shape, data_offset + offset, nbytes)
    return GGUFFile(path, version, metadata, tensors, data_offset, size, spans)


SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
"""The metadata keys every shard of a split model carries (llama.cpp's llama-arch.cpp)."""
_SHARD_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
"""llama.cpp's shard names (llama_split_path: "%s-%05d-of-%05d.gguf", numbered from 1)."""


@dataclass(frozen=True)
class GGUFModel:
    """A model's GGUF files read as one: a single file, or a split model's shards in
    order (the metadata is the first shard's; tensors from every shard, by name)."""

    files: tuple[GGUFFile, ...]

    @property
    def path(self) -> Path:
        """The first shard: what llama.cpp is given (it finds the rest by their names)."""
        return self.files[0].path

    @property
    def paths(self) -> list[Path]:
        return [f.path for f in self.files]

    @property
    def metadata(self) -> dict[str, Any]:
        return self.files[0].metadata

    @cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every shard's tensors (offsets within their own shard: see `files` for which)."""
        return {name: t for f in self.files for name, t in f.tensors.items()}

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def architecture(self) -> str:
        return self.files[0].architecture

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.files[0].arch_value(key, default)


def shard_paths(path: str | os.PathLike) -> list[Path]:
    """The files a model path stands for: every shard of a split model, from any one of
    them, first to last (by llama.cpp's names); else the path alone."""
    path = Path(path).expanduser()
    match = _SHARD_NAME.search(path.name)
    if match is None:
        return [path]
    prefix, count = path.name[:match.start()], int(match[2])
    return [path.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def read_model(path: str | os.PathLike) -> GGUFModel:
    """The GGUF model at `path`, all its shards when it is split (ModelLoadError names a
    missing or foreign shard). Cached by each file's size and modification time: the
    plan asks about one file several times, and a header holds a whole vocabulary."""
    paths = shard_paths(path)
    if len(paths) > 1 and not Path(path).expanduser().is_file():
        paths = [Path(path).expanduser()]  # a name like a shard's, of no file: read_gguf names it
    stamps = tuple((str(p), *_stamp(p)) for p in paths)
    return _read_model(stamps)


def _stamp(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError:
        return -1, -1
    return st.st_size, st.st_mtime_ns


@lru_cache(maxsize=8)
def _read_model(stamps: tuple[tuple[str, int, int], ...]) -> GGUFModel:
    paths = [Path(s[0]) for s in stamps]
    missing = [p for p in paths if not p.is_file()]
    if len(paths) > 1 and missing:
        raise ModelLoadError(f"{missing[0]} is missing: the model is split into {len(paths)} files and llama.cpp "
                             f"needs every one. Download the missing part{'s' if len(missing) > 1 else ''} "
                             f"({', '.join(p.name for p in missing)}) into {paths[0].parent}.")
    files = tuple(read_gguf(p) for p in paths)
    first = files[0].metadata
    count = first.get(SPLIT_COUNT, 1)
    if len(files) == 1 and count not in (0, 1):
        raise ModelLoadError(f"{paths[0]} is one part of a model split into {count} files, but its name does not "
                             f"say which (llama.cpp names them NAME-00001-of-{count:05d}.gguf). Give the parts "
                             f"their names back.")
    for i, f in enumerate(files):
        if len(files) > 1 and (f.metadata.get(SPLIT_NO) != i or f.metadata.get(SPLIT_COUNT) != len(files)):
            raise ModelLoadError(f"{f.path} does not say it is part {i + 1} of {len(files)} (its {SPLIT_NO} is "
                                 f"{f.metadata.get(SPLIT_NO)!r}, {SPLIT_COUNT} {f.metadata.get(SPLIT_COUNT)!r}): "
                                 f"the parts come from different downloads. Download the model's parts again.")
    model = GGUFModel(files)
    expected = first.get(SPLIT_TENSORS)
    if len(files) > 1 and expected is not None and expected != len(model.tensors):
        raise ModelLoadError(f"{paths[0].name} and its other parts hold {len(model.tensors)} tensors where the model "
                             f"has {expected}: a part is damaged or from another download. Download it again.")
    return model
