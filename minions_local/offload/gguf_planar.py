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


def dequantize_planar(planar: torch.Tensor, kind: str | int | BlockType, shape: Sequence[int], *,
                      out: torch.Tensor) -> torch.Tensor:
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
    planar = planar.reshape(-1)
    device = planar.device
    weights = out.view(-1) if out.dtype == torch.float32 else _WORKSPACE.take("weights", (numel,), torch.float32,
                                                                                device)
    end = _integers_into(weights, planar, spec, numel)
    n = numel // btype.block_size
    fields = []
    for a, b in spec.fields:
        fields.append(planar[end : end + n * (b - a)].view(n, b - a))
        end += n * (b - a)
    _AFFINE[btype.name](weights.view(n, btype.block_size), fields)
    if weights is not out:
        out.view(-1).copy_(weights)
    return out


def _integers_into(weights: torch.Tensor, planar: torch.Tensor, spec: PlanarSpec, numel: int) -> int:
    """Unpack the integers into `weights` (float32, exact); returns where the fields begin."""
    if spec.whole_bytes:
        weights.copy_(planar[:numel].view(torch.int8))
        return numel
    half = numel // 2
    ints = _WORKSPACE.take("ints", (numel,), torch.uint8, planar.device)
    nibbles = planar[:half]
    torch.bitwise_and(nibbles, 0x0F, out=ints[:half])
    torch.bitwise_right_shift(nibbles, 4, out=ints[half:])  # uint8: a logical shift
    end = half
    if spec.high_bits:
        width = spec.high_bits
        part = numel * width // 8
        high = _WORKSPACE.take("high", (8 // width, part), torch.uint8, planar.device)
        shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=planar.device).view(-1, 1)
        torch.bitwise_right_shift(planar[end : end + part].view(1, -1), shifts, out=high)
        high &= (1 << width) - 1
        high <<= 4
        ints |= high.view(-1)
        end += part
    if spec.offset:
        ints -= spec.offset  # wraps to the signed value's two's complement
        weights.copy_(ints.view(torch.int8))
    else:
        weights.copy_(ints)
    return end


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
