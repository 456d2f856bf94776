"""A GGUF tensor's blocks re-packed in planes, so that a streamed pass unpacks them in a few whole-tensor ops.

A GGUF block interleaves its scales with its integers, and orders its nibbles for
ggml's SIMD kernels: unpacking it into weight order takes a strided gather per block.
Torch on a CPU pays ~10 us per op whatever its size, and a strided copy runs several
times slower than a contiguous one, so the file's own layout cost 13 ms a SmolLM2
layer (AVX2 EPYC, 1 thread) against 0.5 ms to widen the same weights from bf16.

The planar form holds the same bytes of information in the same number of bytes,
arranged for contiguous whole-tensor ops. For a tensor of N weights in n blocks:

1. the low four bits of every integer, N / 2 bytes: byte k holds weight k in its low
   nibble and weight k + N/2 in its high one (Q8_0: its N int8 integers as they are);
2. the bits above those four (Q5_0 / Q5_K: 1, Q6_K: 2), N * w / 8 bytes: with
   P = N * w / 8, bits [j*w, (j+1)*w) of byte k belong to weight k + j * P;
3. each block's other fields (its float16 scales, Q4_K's packed 6-bit scales, Q6_K's
   int8 ones), one contiguous plane per field, in the order the spec lists them.

Float types (F32, F16, BF16) stay as they are. Dequantizing then is: two nibble ops,
three more per extra bit width, one integer-to-float conversion, and the block's
multiply (and add); the arithmetic is gguf_blocks' own, op for op, so the result stays
bit-identical in float32 to the `gguf` package's reference (tests check every type).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minions_local.offload.gguf_blocks import BlockType, Workspace, block_type, dequantize, integers, k_scales


@dataclass(frozen=True, slots=True)
class PlanarSpec:
    """How one quantized block type is laid out in planes."""

    high_bits: int
    """Bits of each integer above the low four (8-bit integers: stored whole, see `whole_bytes`)."""
    fields: tuple[tuple[int, int], ...]
    """Byte ranges of a block, other than its integers, each kept as a plane of its own."""
    offset: int = 0
    """Subtracted from the stored (unsigned) integer to give the signed one."""
    whole_bytes: bool = False
    """Integers stored as int8 bytes (Q8_0), no nibbles."""


_K_FIELDS = ((0, 2), (2, 4), (4, 16))  # d, dmin, 12 bytes of packed 6-bit scales and mins

SPECS: dict[str, PlanarSpec] = {
    "Q4_0": PlanarSpec(0, ((0, 2),), offset=8),
    "Q4_1": PlanarSpec(0, ((0, 2), (2, 4))),
    "Q5_0": PlanarSpec(1, ((0, 2),), offset=16),
    "Q8_0": PlanarSpec(0, ((0, 2),), whole_bytes=True),
    "Q4_K": PlanarSpec(0, _K_FIELDS),
    "Q5_K": PlanarSpec(1, _K_FIELDS),
    "Q6_K": PlanarSpec(2, ((192, 208), (208, 210)), offset=32),
}
"""The planar form of each quantized type; a type not here streams as the file stores it."""

_WORKSPACE = Workspace()
"""Temporaries of the streamed pass (its compute thread is the only caller)."""


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def to_planar(raw: torch.Tensor, kind: str | int | BlockType, shape: Sequence[int]) -> torch.Tensor:
    """The planar form of a tensor of `shape` stored as the GGUF blocks `raw` (uint8):
    a new uint8 tensor of the same number of bytes."""
    btype = block_type(kind)
    raw = raw.reshape(-1)
    if raw.numel() != btype.nbytes(shape):
        raise ValueError(f"{btype.name} tensor of shape {tuple(shape)} needs {btype.nbytes(shape)} bytes, "
                         f"got {raw.numel()}")
    spec = SPECS.get(btype.name)
    if spec is None:
        return raw.clone()
    blocks = raw.view(-1, btype.type_size)
    q = integers(blocks, btype).reshape(-1)
    parts = [q] if spec.whole_bytes else [_nibble_plane(q)]
    if spec.high_bits:
        parts.append(_high_plane(q >> 4, spec.high_bits))
    parts += [blocks[:, a:b].reshape(-1) for a, b in spec.fields]
    return torch.cat(parts)


def _nibble_plane(q: torch.Tensor) -> torch.Tensor:
    half = q.numel() // 2
    return (q[:half] & 0x0F) | ((q[half:] & 0x0F) << 4)


def _high_plane(high: torch.Tensor, width: int) -> torch.Tensor:
    planes = high.view(8 // width, -1)
    packed = torch.zeros_like(planes[0])
    for j in range(planes.shape[0]):
        packed |= planes[j] << (j * width)
    return packed


CHUNK_WEIGHTS = 1 << 22
"""Weights dequantized per step. Larger than any tensor of a small model, so a CPU
runs each op once over the tensor (an op costs ~10 us whatever its size: chunks that
fit L2 measured slower); it bounds the temporaries for a big model's matrices (a 70B's
MLP weight is 235 M weights: whole, its float32 temporary would take 940 MB of VRAM)."""


def dequantize_planar(planar: torch.Tensor, kind: str | int | BlockType, shape: Sequence[int], *,
                      out: torch.Tensor, chunk: int = CHUNK_WEIGHTS) -> torch.Tensor:
    """Write the weights of a tensor of `shape` held in planar form (`to_planar`) into
    `out` (contiguous, any float dtype: a 16-bit one gets each float32 weight rounded once)."""
    btype = block_type(kind)
    spec = SPECS.get(btype.name)
    if spec is None:
        return dequantize(planar.reshape(-1), btype, shape, out=out)
    numel = _numel(shape)
    if planar.numel() != btype.nbytes(shape) or out.numel() != numel:
        raise ValueError(f"planar {btype.name} tensor of shape {tuple(shape)}: {planar.numel()} bytes "
                         f"(needs {btype.nbytes(shape)}), out of {out.numel()} weights")
    planar, flat, size = planar.reshape(-1), out.view(-1), btype.block_size
    n = numel // size
    fields, start = [], _integer_bytes(spec, numel)
    for a, b in spec.fields:
        fields.append(planar[start : start + n * (b - a)].view(n, b - a))
        start += n * (b - a)
    step = max(size, chunk // size * size)
    for a in range(0, numel, step):
        b = min(numel, a + step)
        weights = flat[a:b] if out.dtype == torch.float32 else _WORKSPACE.take("weights", (b - a,), torch.float32,
                                                                                 planar.device)
        _integers_into(weights, planar, spec, numel, a, b)
        _AFFINE[btype.name](weights.view(-1, size), [f[a // size : b // size] for f in fields])
        if out.dtype != torch.float32:
            flat[a:b].copy_(weights)
    return out


def _integer_bytes(spec: PlanarSpec, numel: int) -> int:
    """Bytes of the integer planes (where the fields begin)."""
    return numel if spec.whole_bytes else numel // 2 + numel * spec.high_bits // 8


def _integers_into(weights: torch.Tensor, planar: torch.Tensor, spec: PlanarSpec, numel: int, a: int, b: int) -> None:
    """Weights [a, b)'s integers into `weights` (float32, exact)."""
    if spec.whole_bytes:
        weights.copy_(planar[a:b].view(torch.int8))
        return
    half = numel // 2
    ints = _WORKSPACE.take("ints", (b - a,), torch.uint8, planar.device)
    if a < half:  # low nibbles: weights [0, half)
        e = min(b, half)
        torch.bitwise_and(planar[a:e], 0x0F, out=ints[: e - a])
    if b > half:  # high nibbles: weights [half, numel); a uint8 shift is a logical one
        s = max(a, half)
        torch.bitwise_right_shift(planar[s - half : b - half], 4, out=ints[s - a :])
    if spec.high_bits:
        width, part = spec.high_bits, numel * spec.high_bits // 8
        planes = planar[half : half + part]
        high = _WORKSPACE.take("high", (b - a,), torch.uint8, planar.device)
        for j in range(8 // width):  # bits [j*width, (j+1)*width) of byte k: weight j*part + k
            s, e = max(a, j * part), min(b, (j + 1) * part)
            if s < e:
                torch.bitwise_right_shift(planes[s - j * part : e - j * part], j * width, out=high[s - a : e - a])
        high &= (1 << width) - 1
        high <<= 4
        ints |= high
    if spec.offset:
        ints -= spec.offset  # wraps to the signed value's two's complement
        weights.copy_(ints.view(torch.int8))
    else:
        weights.copy_(ints)


def _f32(field: torch.Tensor) -> torch.Tensor:
    """A plane of float16 (as bytes [n, 2]) widened to float32 [n, 1]: exact."""
    return field.reshape(-1).view(torch.float16).to(torch.float32).view(-1, 1)


def _scaled(w: torch.Tensor, fields: list[torch.Tensor]) -> None:
    w.mul_(_f32(fields[0]))


def _q4_1(w: torch.Tensor, fields: list[torch.Tensor]) -> None:
    w.mul_(_f32(fields[0])).add_(_f32(fields[1]))


def _k_quant(w: torch.Tensor, fields: list[torch.Tensor]) -> None:
    n = w.shape[0]
    scales, mins = k_scales(fields[2])
    step = (_f32(fields[0]) * scales.to(torch.float32)).view(n, 8, 1)
    low = (_f32(fields[1]) * mins.to(torch.float32)).view(n, 8, 1)
    w.view(n, 8, 32).mul_(step).sub_(low)


def _q6_k(w: torch.Tensor, fields: list[torch.Tensor]) -> None:
    n = w.shape[0]
    step = (_f32(fields[1]) * fields[0].view(torch.int8).to(torch.float32)).view(n, 16, 1)
    w.view(n, 16, 16).mul_(step)


_AFFINE = {"Q4_0": _scaled, "Q4_1": _q4_1, "Q5_0": _scaled, "Q8_0": _scaled, "Q4_K": _k_quant, "Q5_K": _k_quant,
           "Q6_K": _q6_k}
"""Each type's per-block arithmetic on its integers (as float32 [n, block_size]), as in gguf_blocks."""
