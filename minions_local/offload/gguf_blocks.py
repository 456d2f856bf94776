"""GGUF's quantized blocks, turned back into weights by torch code on the compute device.

A GGUF tensor is stored row by row, each row a run of fixed-size blocks; a block holds
`block_size` weights in `type_size` bytes (a float16 scale or two, then packed
integers). A streamed GGUF layer moves in these bytes and is dequantized right before
it runs, so the dequantizers here are vectorised torch code (CPU and CUDA alike, no
numpy), one function per block type, each the layout of ggml's `dequantize_row_*`.

Exactness: every function computes in float32 with the same operations, in the same
order, as the `gguf` package's reference (`gguf.quants.dequantize`): the float16
scales widen exactly, the integer parts are exact in float32, and every multiply and
add is its own rounding (no fused multiply-add, which would round once where the
reference rounds twice). So the result is bit-identical to the reference, which the
tests check for every type; a 16-bit compute dtype then rounds that float32 value once.

On a CPU the work goes in chunks of blocks whose temporaries stay in the core's cache:
each elementwise op over a whole 14 MB layer would be a trip to memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minions_local.models.gguf_file import GGML_TYPES


CPU_CHUNK_WEIGHTS = 1 << 16
"""Weights dequantized per step on a CPU: a chunk's float32 output (256 KiB) and its
byte-sized temporaries stay in L2, so the half-dozen elementwise ops per block type
read and write cache, not memory (scripts/bench.py gguf-dequant measures chunk sizes)."""


@dataclass(frozen=True, slots=True)
class BlockType:
    """One GGUF tensor type: its ggml id, and how many weights fit how many bytes."""

    name: str
    ggml_type: int
    block_size: int
    type_size: int

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` weights."""
        if cols % self.block_size:
            raise ValueError(f"a {self.name} row holds a multiple of {self.block_size} weights, not {cols}")
        return cols // self.block_size * self.type_size

    def nbytes(self, shape: Sequence[int]) -> int:
        """Bytes of a tensor of `shape` (rows x columns, torch order)."""
        rows = 1
        for s in shape[:-1]:
            rows *= s
        return rows * self.row_bytes(shape[-1])

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block_size


# -- the block types ------------------------------------------------------------------
# Each kernel takes blocks [n, type_size] (uint8) and writes out [n, block_size] (float32).


def f16_field(blocks: torch.Tensor, byte: int) -> torch.Tensor:
    """The float16 stored at `byte` of every block, widened to float32, as [n, 1]."""
    return blocks[:, byte : byte + 2].contiguous().view(torch.float16).to(torch.float32)


class Workspace:
    """Reusable temporaries for the kernels, grown to the largest tensor seen.

    A fresh multi-megabyte temporary on a CPU is fresh pages, and faulting them in cost
    more than the arithmetic (measured: 60 us per allocation, a dozen per layer)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device], torch.Tensor] = {}

    def take(self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        key = (name, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype).view(tuple(shape))


_WORKSPACE = Workspace()
"""Used when a caller passes none (the compute thread is the only caller in a pass)."""


def _split_nibbles(blocks: torch.Tensor) -> torch.Tensor:
    """Every byte of `blocks` [n, type_size] split in two: uint8 [2, n, type_size],
    [0] the low nibbles, [1] the high ones.

    The masks run over whole 16-bit words of the contiguous block array (every block
    size is even): two flat ops, where masking the packed bytes in place would be a
    strided op per block row, several times slower on a CPU."""
    words = blocks.reshape(-1).view(torch.int16)
    both = _WORKSPACE.take("nibbles", (2, words.numel()), torch.int16, blocks.device)
    torch.bitwise_and(words, 0x0F0F, out=both[0])
    torch.bitwise_right_shift(words, 4, out=both[1])
    both[1] &= 0x0F0F  # an arithmetic shift's sign bits land outside the mask
    return both.view(torch.uint8).view(2, *blocks.shape)


def _gather(nibbles: torch.Tensor, start: int, shape: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    """A view of `nibbles` ([2, n, type_size] from `_split_nibbles`) picking each
    block's integers in ggml's order, copied out in one op. `strides` are in bytes of
    a block; the stride of the nibble half is filled in."""
    n, size = nibbles.shape[1], nibbles.shape[2]
    strides = [n * size if s is None else s for s in strides]
    view = nibbles.as_strided((n, *shape), (size, *strides), nibbles.storage_offset() + start)
    return _WORKSPACE.take("quants", view.shape, torch.uint8, view.device).copy_(view).view(n, -1)


def _bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Packed bytes [n, b] -> [n, 8 // width, b]: field j holds bits [j*width, (j+1)*width) of each byte."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device).view(1, -1, 1)
    return (packed.unsqueeze(1) >> shifts) & ((1 << width) - 1)


def _small_quants(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Q4_0 / Q4_1 / Q5_0: 16 bytes from `start` hold 32 nibbles, the low ones first: uint8 [n, 32]."""
    return _gather(_split_nibbles(blocks), start, (2, 16), (None, 1))


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    q = _small_quants(blocks, 2).sub_(8).view(torch.int8)  # the integer, exact in uint8 arithmetic
    out.copy_(q)
    out.mul_(f16_field(blocks, 0))


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_small_quants(blocks, 4))
    out.mul_(f16_field(blocks, 0)).add_(f16_field(blocks, 2))


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    high = _bits(blocks[:, 2:6], 1).transpose(1, 2).reshape(out.shape)  # bit j of the little-endian u32
    q = (_small_quants(blocks, 6) | (high << 4)).sub_(16).view(torch.int8)
    out.copy_(q)
    out.mul_(f16_field(blocks, 0))


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.mul_(f16_field(blocks, 0))


def k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 8 six-bit scales and mins packed in 12 bytes, as uint8 [n, 8] each."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return scales, mins


def _k_affine(blocks: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    """out = (d * scale) * q - (dmin * min) per 32-weight sub-block, q as uint8 [n, 256]."""
    n = blocks.shape[0]
    scales, mins = k_scales(blocks[:, 4:16])
    step = (f16_field(blocks, 0) * scales.to(torch.float32)).view(n, 8, 1)
    low = (f16_field(blocks, 2) * mins.to(torch.float32)).view(n, 8, 1)
    out.copy_(q)
    grid = out.view(n, 8, 32)
    grid.mul_(step).sub_(low)


def _k_nibbles(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: 128 bytes from byte 16 (Q4_K) or 48 (Q5_K) of the block, as 4
    groups of 32 bytes: sub-block 2g is group g's low nibbles, 2g + 1 its high ones."""
    start = blocks.shape[1] - 128
    return _gather(_split_nibbles(blocks), start, (4, 2, 32), (32, None, 1))


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _k_affine(blocks, _k_nibbles(blocks), out)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    high = _bits(blocks[:, 16:48], 1).view(n, -1)  # sub-block s takes bit s of each of the 32 bytes
    _k_affine(blocks, _k_nibbles(blocks) | (high << 4), out)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    # Two halves of 64 bytes; in each, 32-weight sub-blocks take the low nibbles of
    # bytes 0-31, of 32-63, then the high nibbles of the same; the top 2 bits come from
    # one 32-byte run of qh per half, 2 bits per sub-block.
    low = _gather(_split_nibbles(blocks), 0, (2, 2, 2, 32), (64, None, 32, 1))
    high = _bits(blocks[:, 128:192].reshape(n * 2, 32), 2).view(n, -1)
    q = (low | (high << 4)).sub_(32).view(torch.int8)
    scale = blocks[:, 192:208].view(torch.int8).to(torch.float32)
    step = (f16_field(blocks, 208) * scale).view(n, 16, 1)
    out.copy_(q)
    out.view(n, 16, 16).mul_(step)


def _f32(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.contiguous().view(torch.float32))


def _f16_weights(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.contiguous().view(torch.float16))


def _bf16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.contiguous().view(torch.bfloat16))  # widening bf16 is a shift: exact


def integers(raw: torch.Tensor, kind: str | int | BlockType) -> torch.Tensor:
    """The integers a quantized tensor's blocks store, unsigned as stored (no offset
    taken off yet; Q8_0's int8 bytes as they are), in weight order: uint8 [n, block_size].
    What gguf_planar.py re-packs; not on any hot path."""
    btype = block_type(kind)
    blocks = raw.reshape(-1, btype.type_size)
    n = blocks.shape[0]
    if btype.name in ("Q4_0", "Q4_1"):
        q = _small_quants(blocks, 2 if btype.name == "Q4_0" else 4)
    elif btype.name == "Q5_0":
        q = _small_quants(blocks, 6) | (_bits(blocks[:, 2:6], 1).transpose(1, 2).reshape(n, 32) << 4)
    elif btype.name == "Q8_0":
        q = blocks[:, 2:]
    elif btype.name == "Q4_K":
        q = _k_nibbles(blocks)
    elif btype.name == "Q5_K":
        q = _k_nibbles(blocks) | (_bits(blocks[:, 16:48], 1).view(n, -1) << 4)
    elif btype.name == "Q6_K":
        low = _gather(_split_nibbles(blocks), 0, (2, 2, 2, 32), (64, None, 32, 1))
        q = low | (_bits(blocks[:, 128:192].reshape(n * 2, 32), 2).view(n, -1) << 4)
    else:
        raise ValueError(f"{btype.name} stores floats, not integers")
    return q.reshape(n, btype.block_size).clone()  # the nibble helpers return reused workspace


_KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "F32": _f32, "F16": _f16_weights, "BF16": _bf16, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0,
    "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


BLOCK_TYPES: dict[str, BlockType] = {
    name: BlockType(name, ggml_type, block, size)
    for ggml_type, (name, block, size) in GGML_TYPES.items() if name in _KERNELS
}
"""The types a GGUF target may stream, by ggml's name."""

BY_GGML_TYPE: dict[int, BlockType] = {t.ggml_type: t for t in BLOCK_TYPES.values()}


def block_type(kind: str | int | BlockType) -> BlockType:
    """A supported type by name ('Q4_K') or ggml id; ValueError names the unsupported one."""
    if isinstance(kind, BlockType):
        return kind
    found = BY_GGML_TYPE.get(kind) if isinstance(kind, int) else BLOCK_TYPES.get(str(kind).upper())
    if found is None:
        if isinstance(kind, int) and kind in GGML_TYPES:
            kind = GGML_TYPES[kind][0]
        raise ValueError(f"GGUF tensor type {kind!r} is not supported; supported: {', '.join(BLOCK_TYPES)}")
    return found


def dequantize(raw: torch.Tensor, kind: str | int | BlockType, shape: Sequence[int], *,
               out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
               chunk: int | None = None) -> torch.Tensor:
    """The weights of a GGUF tensor of `shape` from its bytes `raw` (uint8, on any device).

    Writes into `out` when given (its dtype wins over `dtype`), else a new tensor.
    A 16-bit `out` gets each float32 weight rounded once. `chunk`: weights per step
    (default: CPU_CHUNK_WEIGHTS on a CPU, everything at once elsewhere)."""
    btype = block_type(kind)
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    if raw.dtype != torch.uint8 or raw.numel() != btype.nbytes(shape):
        raise ValueError(f"{btype.name} tensor of shape {shape} needs {btype.nbytes(shape)} bytes (uint8), "
                         f"got {raw.numel()} ({raw.dtype})")
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=raw.device)
    elif tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of shape {shape}, got {tuple(out.shape)}")
    blocks = raw.reshape(-1, btype.type_size)
    flat = out.view(-1, btype.block_size)
    if chunk is None:
        chunk = CPU_CHUNK_WEIGHTS if raw.device.type == "cpu" else numel
    step = max(1, chunk // btype.block_size)
    kernel = _KERNELS[btype.name]
    widened = out.dtype == torch.float32
    scratch = None if widened else torch.empty(min(step, blocks.shape[0]), btype.block_size,
                                               dtype=torch.float32, device=raw.device)
    for start in range(0, blocks.shape[0], step):
        part = blocks[start : start + step]
        if widened:
            kernel(part, flat[start : start + step])
        else:
            tmp = scratch[: part.shape[0]]
            kernel(part, tmp)
            flat[start : start + step].copy_(tmp)
    return out
