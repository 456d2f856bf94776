"""Dtype names: the one table for pack files, loaders and user settings.

Pack files and layouts store a dtype by its torch name ('bfloat16', 'int8'); users and
profiles may also write the short forms ('bf16', 'fp16', 'half', 'torch.float32').
Only floating dtypes are compute dtypes; the integer ones hold quantized weights.
"""

from __future__ import annotations

import functools

import torch

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
"""Stored name -> torch dtype."""
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype a pack file or layout stores under `name` (exact names only)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} in a layer pack") from None


def compute_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A compute dtype from a torch dtype or a name as a user writes it."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    name = ALIASES.get(name, name)
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use {', '.join(COMPUTE_DTYPES)} "
                         f"(or {', '.join(sorted(ALIASES))}).")
    return DTYPES[name]


def fast_compute_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype to compute weights stored in `dtype` with on `device`: `dtype` itself,
    except bfloat16 on a CPU without bf16 matmul kernels, where it is float32.

    Without them (AVX2-only CPUs, AMD before Zen 4) torch falls back to a scalar bf16
    matmul whose cost grows with every row: measured on a 2-core AVX2 EPYC, a
    576x1536 matmul of 64 rows took 7.4 ms in bf16 against 1.05 ms in float32 (15
    against 108 GFLOPS), so a 64-node tree pass of SmolLM2 cost 8x a 1-token pass and
    no tree paid. Widening bf16 weights to float32 is exact; the weights stay bf16 where
    they are stored and streamed (quant 'bf16'), so bytes per pass do not change."""
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not cpu_has_bf16_matmul():
        return torch.float32
    return dtype


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX-512 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no way to tell
        return True
