"""Prepacked oneDNN matmuls: a weight reordered once into oneDNN's blocked layout, so a
CPU matmul of a few rows skips the reorder transformers' F.linear pays on every call
(2-2.5x faster on this project's 2-core box). Used only where it is bit-exact."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


TIED_HEAD_COPY = 64 << 20
"""Bytes up to which a tied lm_head gets a packed copy of its own (a 128k-token
vocabulary's head is hundreds of MB: it stays shared with the embedding)."""


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) on oneDNN, the weight prepacked (`pack_weight`) or plain (a
    streamed layer's buffer)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def row_invariant_matmuls(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether oneDNN's matmuls give a row the same bits at any row count from 2 up, in
    `dtype` here (plain and prepacked weights). Measured on an AVX-512 EPYC: true for
    bfloat16 and float32, where MKL's float32 (F.linear's) differs at 1, 7, 16... rows."""
    if torch.device(device).type != "cpu":
        return False
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(1)
        weight = (torch.randn(160, 96, generator=g) * 0.1).to(dtype)
        x = torch.randn(1, 600, 96, generator=g).to(dtype)
        for w, linear in ((weight, onednn_linear), (pack_weight(weight), onednn_linear)):
            reference = linear(x[:, :2], w)[0, 0]
            for rows in (3, 7, 16, 33, 128, 600):
                if not torch.equal(linear(x[:, :rows], w)[0, 0], reference):
                    return False
        return True
    except (RuntimeError, AttributeError):  # a build without these oneDNN ops
        return False


def packing_is_exact(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether prepacked oneDNN matmuls give bit-identical results to F.linear here.

    Checked once per dtype on this build: true for bf16 on x86 CPUs (both paths are
    oneDNN), false for fp32 (F.linear uses MKL there). Only exact packing is used, so
    a packed target still decodes token-identically to transformers."""
    return device.type == "cpu" and _packed_matches(dtype)


@functools.cache
def _packed_matches(dtype: torch.dtype) -> bool:
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        weight = torch.randn(96, 64, generator=g).to(dtype)
        bias = torch.randn(96, generator=g).to(dtype)
        packed = pack_weight(weight)
        for rows in (1, 3, 17):
            x = torch.randn(1, rows, 64, generator=g).to(dtype)
            if not torch.equal(F.linear(x, weight, bias), onednn_linear(x, packed, bias)):
                return False
        return True
    except (RuntimeError, AttributeError):  # a build without these oneDNN ops
        return False
