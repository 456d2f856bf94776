"""GGUF 4-bit tensors multiplied as they are, through torch's packed int4 CPU kernel.

A GGUF pass on the CPU spent more time turning blocks into float32 weights (3.95 ms a
SmolLM2 layer, AVX2 EPYC, 2 threads) than multiplying them (1.4 ms), so streaming a
third of bf16's bytes ran no faster than bf16 (bench.py --gguf-target). torch's
`_weight_int4pack_mm_for_cpu` multiplies bf16 activations by 4-bit integers in
groups of 32 input columns, each group with its own scale and zero:
weight = (q - 8) * scale + zero. That is every 32-weight block of Q4_0 and Q4_1, and
every 32-weight sub-block of Q4_K, written another way:

- Q4_0: w = (q - 8) * d                  scale d, zero 0
- Q4_1: w = q * d + m                    scale d, zero m + 8 d
- Q4_K: w = q * (d * sc) - dmin * mn     scale d * sc, zero 8 d sc - dmin mn

So a layer's Q4 tensors are stored once, at pack time, in the kernel's own layout
(`_convert_weight_to_int4pack_for_cpu`: [N, K/2] bytes) plus a bfloat16 plane of
(scale, zero) pairs [K/32, N, 2], the same 20 bytes per 32 weights as Q4_1 (Q4_0 and
Q4_K grow by a ninth), and a pass multiplies them with no dequantization at all: the
7 matmuls of a SmolLM2 layer take 0.45 ms for one row against 5.4 ms.

What it changes (say it, since the GGUF target is meant to be the file's weights):
the scales and zeros are rounded to bfloat16 (8 bits of mantissa against float16's
11: a weight moves by up to 2^-9 of its block's scale), and each matmul's input and
output are rounded to bfloat16 (the rest of the forward stays float32). The result
is still one fixed model, and the kernel is row-invariant (a row comes out the same
bits alone or among 16, tested), so decoding with trees and batches stays
token-identical to this target's own autoregressive decoding. `gguf_kernel =
"dequant"` in a profile keeps the float32-exact weights instead.

The kernel's byte layout depends on the CPU's vector width (AVX-512 interleaves 64
rows, AVX2 32), so packs record `layout_tag()` and are rewritten on another CPU.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minions_local.offload.gguf_blocks import block_type, f16_field, integers, k_scales
from minions_local.profile.gguf_sizes import INT4_TYPES

GROUP = 32
"""Input columns sharing one (scale, zero): a Q4_0/Q4_1 block, a Q4_K sub-block."""

KERNELS = ("auto", "int4", "dequant")
"""How a GGUF target multiplies its 4-bit tensors: 'int4' through the packed kernel,
'dequant' into float32 weights first (exact), 'auto' int4 where it applies."""


def available(device: torch.device | str) -> bool:
    """The packed kernel runs on this device (torch's CPU build has it since 2.5)."""
    ops = torch.ops.aten
    return torch.device(device).type == "cpu" and hasattr(ops, "_weight_int4pack_mm_for_cpu") \
        and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def applies(kind: str, shape: Sequence[int]) -> bool:
    """A tensor of this block type and shape goes through the kernel: a 4-bit matrix
    whose rows split into whole groups (the kernel also wants an even row count)."""
    return kind in INT4_TYPES and len(shape) == 2 and shape[1] % GROUP == 0 and shape[0] % 2 == 0


def piece_shapes(shape: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """The stored shapes of an [N, K] weight: the packed integers (uint8) and the
    (scale, zero) plane (bfloat16)."""
    n, k = int(shape[0]), int(shape[1])
    return (n, k // 2), (k // GROUP, n, 2)


def affine(raw: torch.Tensor, kind: str, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4 tensor's blocks as the kernel sees them: integers uint8 [N, K] (0..15) and
    float32 scale and zero [N, K/32], exactly (before any bfloat16 rounding)."""
    btype = block_type(kind)
    n, k = int(shape[0]), int(shape[1])
    blocks = raw.reshape(-1, btype.type_size)
    q = integers(blocks, btype).view(n, k)
    groups = n * k // GROUP
    if btype.name == "Q4_K":
        scales, mins = k_scales(blocks[:, 4:16])
        scale = f16_field(blocks, 0) * scales.to(torch.float32)
        zero = 8 * scale - f16_field(blocks, 2) * mins.to(torch.float32)
    elif btype.name == "Q4_1":
        scale = f16_field(blocks, 0)
        zero = f16_field(blocks, 2) + 8 * scale
    elif btype.name == "Q4_0":
        scale = f16_field(blocks, 0)
        zero = torch.zeros_like(scale)
    else:
        raise ValueError(f"{btype.name} is not a 4-bit type the int4 kernel computes ({', '.join(INT4_TYPES)})")
    return q, scale.reshape(groups).view(n, k // GROUP), zero.reshape(groups).view(n, k // GROUP)


def pack(raw: torch.Tensor, kind: str, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's form of a Q4 tensor's blocks `raw`: packed integers uint8 [N, K/2]
    and (scale, zero) bfloat16 [K/32, N, 2]."""
    q, scale, zero = affine(raw, kind, shape)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed.view(torch.uint8).reshape(piece_shapes(shape)[0]), sz


def weights(raw: torch.Tensor, kind: str, shape: Sequence[int]) -> torch.Tensor:
    """The float32 weights [N, K] the kernel multiplies by: (q - 8) * scale + zero with
    scale and zero rounded to bfloat16 (for checks; not on any hot path)."""
    q, scale, zero = affine(raw, kind, shape)
    n, k = q.shape
    scale = scale.to(torch.bfloat16).to(torch.float32).unsqueeze(-1)
    zero = zero.to(torch.bfloat16).to(torch.float32).unsqueeze(-1)
    return ((q.to(torch.float32) - 8).view(n, k // GROUP, GROUP) * scale + zero).view(n, k)


@functools.lru_cache(maxsize=1)
def layout_tag() -> str:
    """A short hash of how this CPU's kernel lays out packed integers (it depends on
    the vector width torch dispatches to): part of a pack's fingerprint."""
    probe = (torch.arange(64 * 64, dtype=torch.int32) * 7 % 16).view(64, 64)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    return hashlib.sha1(packed.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:10]


@dataclass(frozen=True, slots=True, eq=False)
class Int4Weight:
    """One linear weight [N, K] held in the kernel's form (views into a layer buffer)."""

    packed: torch.Tensor
    """uint8 [N, K/2]."""
    sz: torch.Tensor
    """bfloat16 [K/32, N, 2]: each group's scale and zero."""

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.packed.shape[0]), int(self.packed.shape[1]) * 2

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias), in x's dtype; x is rounded to bfloat16 for the kernel."""
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.sz)
        out = out.to(x.dtype).view(*x.shape[:-1], self.packed.shape[0])
        return out if bias is None else out + bias
