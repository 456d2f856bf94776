"""One dtype table: the names users write and the names pack files store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minions_local.backends.hf import resolve_dtype
from minions_local.core.errors import ModelLoadError
from minions_local.offload import streamed
from minions_local.offload.dtypes import compute_dtype, dtype_from_name, dtype_name


def test_user_names_and_their_short_forms():
    assert compute_dtype("BF16") is torch.bfloat16 and compute_dtype("torch.float16") is torch.float16
    assert compute_dtype("half") is torch.float16 and compute_dtype("fp32") is torch.float32
    assert resolve_dtype(None) is None and resolve_dtype("bfloat16") is torch.bfloat16


def test_stored_integer_dtypes_are_not_compute_dtypes():
    assert dtype_from_name(dtype_name(torch.uint8)) is torch.uint8
    with pytest.raises(ValueError, match="use float32, bfloat16, float16"):
        compute_dtype("int8")
    with pytest.raises(ModelLoadError, match="unknown dtype 'fp8'"):
        streamed.weights_dtype("fp8", Path("."))
