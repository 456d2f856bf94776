"""GGUF block dequantizers against the `gguf` package's reference, bit for bit in float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from minions_local.offload.gguf_blocks import BLOCK_TYPES, block_type, dequantize  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

SCALE_BYTES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2],
               "Q6_K": [208]}
"""Where each block keeps its float16 scales: random bytes there would often be inf or NaN."""


def random_tensor(name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """A tensor of random blocks of type `name` (every integer bit pattern), as its bytes [rows, row_bytes]."""
    rng = np.random.default_rng(seed)
    btype = BLOCK_TYPES[name]
    cols = btype.block_size * blocks_per_row
    if name == "F32":
        return rng.normal(size=(rows, cols)).astype(np.float32).view(np.uint8)
    if name in ("F16", "BF16"):
        values = rng.normal(size=(rows, cols)).astype(np.float32)
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType[name]).view(np.uint8)
    raw = rng.integers(0, 256, size=(rows, btype.row_bytes(cols)), dtype=np.uint8)
    blocks = raw.reshape(-1, btype.type_size)
    for byte in SCALE_BYTES[name]:
        scales = (rng.normal(size=(blocks.shape[0], 1)) * 0.05).astype(np.float16)
        blocks[:, byte : byte + 2] = scales.view(np.uint8)
    return raw


def reference(raw: np.ndarray, name: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])


def same_bits(got: torch.Tensor, want: np.ndarray) -> bool:
    got = got.detach().cpu().numpy()
    return got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(BLOCK_TYPES))
def test_random_blocks_match_the_reference(name: str, device: str) -> None:
    for seed, (rows, per_row) in enumerate([(1, 1), (7, 3), (33, 8)]):
        raw = random_tensor(name, rows, per_row, seed)
        want = reference(raw, name)
        got = dequantize(torch.from_numpy(raw.copy()).reshape(-1).to(device), name, want.shape)
        assert same_bits(got, want), f"{name} on {device}, {rows}x{per_row} blocks"


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "BF16", "F16"])
def test_quantized_by_the_reference_round_trips(name: str) -> None:
    """Blocks as `gguf.quants.quantize` writes them (real scales, real integers)."""
    weights = np.random.default_rng(5).normal(size=(48, 256)).astype(np.float32)
    raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[name])
    want = reference(raw, name)
    assert same_bits(dequantize(torch.from_numpy(raw.copy()).view(torch.uint8).reshape(-1), name, (48, 256)), want)
    assert np.abs(want - weights).max() < 0.5  # the reference itself is a dequantization


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "Q6_K"])
def test_chunked_and_16_bit_outputs(name: str) -> None:
    """Chunks of any size give the same weights; a bf16 or fp16 output is the float32
    weight rounded once."""
    raw = random_tensor(name, 9, 5, seed=11)
    want = reference(raw, name)
    flat = torch.from_numpy(raw.copy()).reshape(-1)
    for chunk in (1, 300, 1 << 20):
        assert same_bits(dequantize(flat, name, want.shape, chunk=chunk), want), chunk
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(want.shape, dtype=dtype)
        dequantize(flat, name, want.shape, out=out, chunk=700)
        assert torch.equal(out, torch.from_numpy(want).to(dtype))


def test_wrong_sizes_and_types_are_refused() -> None:
    raw = torch.zeros(BLOCK_TYPES["Q4_0"].nbytes((2, 64)), dtype=torch.uint8)
    with pytest.raises(ValueError, match="needs 72 bytes"):
        dequantize(raw[:-1], "Q4_0", (2, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(raw, "Q4_0", (3, 48))
    with pytest.raises(ValueError, match="'IQ2_XS' is not supported"):
        block_type("IQ2_XS")
    with pytest.raises(ValueError, match="IQ4_XS. is not supported"):
        block_type(23)
    assert block_type(12).name == "Q4_K" and block_type("q6_k").bits_per_weight == 6.5625


@pytest.mark.realmodel
def test_every_tensor_of_the_shipped_file() -> None:
    """SmolLM2-135M-Instruct.Q4_1.gguf: Q4_1 layers, a Q8_0 embedding, F32 norms."""
    from tests.models.conftest import require_wheel

    require_wheel()
    from minions_local.models.smollm2 import shipped_gguf

    reader = gguf.GGUFReader(shipped_gguf())
    kinds = set()
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        kinds.add(name)
        want = reference(tensor.data, name)
        shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))
        got = dequantize(torch.from_numpy(np.array(tensor.data).view(np.uint8).reshape(-1)), name, shape)
        assert same_bits(got, want.reshape(shape)), tensor.name
    assert kinds == {"Q4_1", "Q8_0", "F32"}
