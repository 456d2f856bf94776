"""Dtype names: the one table for pack files, loaders and user settings.

Pack files and layouts store a dtype by its torch name ('bfloat16', 'int8'); users and
profiles may also write the short forms ('bf16', 'fp16', 'half', 'torch.float32').
Only floating dtypes are compute dtypes; the integer ones hold quantized weights.
"""

from __future__ import annotations

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
