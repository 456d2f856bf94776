"""Weight quantization for streamed layers: fewer bytes per pass, same compute dtype.

A streamed layer moves as packed integers plus scales and is dequantized on the
compute side, right before it runs, into the compute dtype. Only 2-D weights (the
linear projections) are quantized; norms and biases stay in the compute dtype.

- ``int8``: symmetric, one scale per output channel (row), q in [-127, 127].
- ``int4``: symmetric, one scale per group of ``group_size`` input columns,
  q in [-8, 7], two values per byte (even column in the low nibble).
- ``bf16``: the weight in bfloat16, no scale, for a float32 compute dtype: the bytes
  of published bf16 weights, computed in float32 where the CPU has no bf16 matmul
  kernels (offload/dtypes.py, `fast_compute_dtype`); widening is exact.

Scales are stored in the compute dtype and the integers are computed from the
*stored* scale, so `dequantize` is the only definition of the weights the model
runs with: a reference model built with `dequantize_weight` is exactly the
streamed model.
"""

from __future__ import annotations

import torch

QUANT_MODES = ("none", "int8", "int4", "bf16")
INT4_GROUP = 64


def quantizable(name: str, tensor: torch.Tensor) -> bool:
    """Linear weights only: 2-D, named `.weight`, and wide enough to be worth it."""
    return name.endswith("weight") and tensor.ndim == 2 and min(tensor.shape) >= 8


def int4_group_size(in_features: int, preferred: int = INT4_GROUP) -> int:
    """The largest even group size <= preferred that divides the row (row = one group otherwise)."""
    for g in range(preferred, 1, -2):
        if in_features % g == 0:
            return g
    return in_features


def quantize_weight(w: torch.Tensor, mode: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Quantize a [out, in] weight; returns the pieces to store ('q', 'scale')."""
    if mode == "bf16":
        return {"q": w.detach().to(torch.bfloat16).contiguous()}
    w32 = w.detach().to(torch.float32)
    tiny = torch.finfo(dtype).tiny
    if mode == "int8":
        scale = (w32.abs().amax(dim=1) / 127.0).clamp_min(tiny).to(dtype)
        q = torch.round(w32 / scale.to(torch.float32)[:, None]).clamp_(-127, 127).to(torch.int8)
        return {"q": q.contiguous(), "scale": scale.contiguous()}
    if mode == "int4":
        out_f, in_f = w32.shape
        if in_f % 2:
            raise ValueError(f"int4 needs an even number of input columns, got {in_f}")
        g = int4_group_size(in_f)
        grouped = w32.reshape(out_f, in_f // g, g)
        scale = (grouped.abs().amax(dim=2) / 7.0).clamp_min(tiny).to(dtype)
        q = torch.round(grouped / scale.to(torch.float32)[..., None]).clamp_(-8, 7)
        q = (q.to(torch.int16) + 8).to(torch.uint8).reshape(out_f, in_f)
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
        return {"q": packed.contiguous(), "scale": scale.contiguous()}
    raise ValueError(f"unknown quantization {mode!r}; use one of {QUANT_MODES}")


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, mode: str, out: torch.Tensor) -> torch.Tensor:
    """Write the weight that `quantize_weight` stands for into `out` ([out, in], compute dtype).

    Every step is exact except the one rounding of the final multiply (the integer times
    the scale fits a float32 exactly), so computing in float32 and storing in a 16-bit
    dtype gives the same bits as computing in that dtype. CPUs lack fast 16-bit
    elementwise kernels, so there the work goes through a float32 temporary; elsewhere
    it is done in place in `out`.
    """
    if mode == "bf16":
        return out.copy_(q)
    if out.dtype != torch.float32 and out.device.type == "cpu":
        tmp = torch.empty(out.shape, dtype=torch.float32)
        _dequantize_into(q, scale.to(torch.float32), mode, tmp)
        return out.copy_(tmp)
    return _dequantize_into(q, scale.to(out.dtype), mode, out)


def _dequantize_into(q: torch.Tensor, scale: torch.Tensor, mode: str, out: torch.Tensor) -> torch.Tensor:
    if mode == "int8":
        out.copy_(q)
        out.mul_(scale[:, None])
        return out
    if mode == "int4":
        out_f = out.shape[0]
        n_groups = scale.shape[1]
        pairs = out.view(out_f, -1, 2)
        pairs[..., 0] = q & 0x0F
        pairs[..., 1] = q >> 4
        out.view(out_f, n_groups, -1).sub_(8).mul_(scale[..., None])
        return out
    raise ValueError(f"unknown quantization {mode!r}")


def dequantize_weight(w: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor:
    """Round trip through the stored form: the weight a quantized streamed model runs with."""
    if mode == "none":
        return w.to(dtype)
    pieces = quantize_weight(w, mode, dtype)
    out = torch.empty(w.shape, dtype=dtype)
    return dequantize(pieces["q"], pieces.get("scale"), mode, out)


def stored_pieces(name: str, tensor: torch.Tensor, mode: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What one parameter becomes in a pack: {'': tensor} or {'q': ..., 'scale': ...}."""
    if mode != "none" and quantizable(name, tensor):
        return quantize_weight(tensor, mode, dtype)
    return {"": tensor.detach().to(dtype).contiguous()}


@torch.no_grad()
def apply_dequantized_weights_(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Give a resident model's decoder layers the weights a `mode`-quantized streamed
    model runs with (the reference for equivalence checks). Returns the model."""
    if mode == "none":
        return model
    for layer in model.model.layers:
        for name, param in layer.named_parameters():
            if quantizable(name, param):
                param.copy_(dequantize_weight(param.data.cpu(), mode, param.dtype).to(param.device))
    return model
