"""GGUF blocks re-packed in planes (what a streamed GGUF layer holds): the same size as
the file's blocks, and dequantized bit for bit as the `gguf` package's reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from minions_local.offload.gguf_blocks import BLOCK_TYPES  # noqa: E402
from minions_local.offload.gguf_planar import SPECS, dequantize_planar, to_planar  # noqa: E402
from tests.offload.test_gguf_blocks import DEVICES, random_tensor, reference, same_bits  # noqa: E402


def planar_weights(raw: np.ndarray, name: str, shape, *, dtype=torch.float32, device="cpu") -> torch.Tensor:
    flat = torch.from_numpy(raw.copy()).reshape(-1)
    planar = to_planar(flat, name, shape)
    assert planar.dtype == torch.uint8 and planar.numel() == flat.numel()
    out = torch.empty(shape, dtype=dtype, device=device)
    return dequantize_planar(planar.to(device), name, shape, out=out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(BLOCK_TYPES))
def test_planar_blocks_match_the_reference(name: str, device: str) -> None:
    """Random blocks (every integer bit pattern, so every high-bit plane is exercised);
    odd block counts put a block across the nibble plane's halves."""
    for seed, (rows, per_row) in enumerate([(1, 1), (7, 3), (33, 8)]):
        raw = random_tensor(name, rows, per_row, seed)
        want = reference(raw, name)
        assert same_bits(planar_weights(raw, name, want.shape, device=device), want), f"{name} {rows}x{per_row}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_16_bit_outputs_round_the_float32_weight_once(name: str) -> None:
    raw = random_tensor(name, 9, 5, seed=11)
    want = torch.from_numpy(reference(raw, name))
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(planar_weights(raw, name, tuple(want.shape), dtype=dtype), want.to(dtype)), dtype


@pytest.mark.parametrize("name", sorted(SPECS))
def test_chunks_across_the_halves_and_planes_give_the_same_weights(name: str) -> None:
    """Chunks of one block, of a few, and of odd counts land across the nibble halves
    and the high-bit planes: every size gives the reference's weights."""
    raw = random_tensor(name, 7, 3, seed=13)
    want = reference(raw, name)
    planar = to_planar(torch.from_numpy(raw.copy()).reshape(-1), name, want.shape)
    size = BLOCK_TYPES[name].block_size
    for chunk in (size, 3 * size, 5 * size, 1 << 22):
        for dtype in (torch.float32, torch.bfloat16):
            out = dequantize_planar(planar, name, want.shape, out=torch.empty(want.shape, dtype=dtype), chunk=chunk)
            assert torch.equal(out, torch.from_numpy(want).to(dtype)), (chunk, dtype)
    assert same_bits(dequantize_planar(planar, name, want.shape, out=torch.empty(want.shape), chunk=size), want)


def test_the_planes_are_where_the_docstring_says() -> None:
    """Q4_1: weight k in byte k's low nibble, weight k + N/2 in its high one, then the
    float16 scales and mins, each a contiguous plane."""
    raw = random_tensor("Q4_1", 2, 1, seed=3)
    blocks = torch.from_numpy(raw.copy()).reshape(2, 20)
    planar = to_planar(blocks.reshape(-1), "Q4_1", (2, 32))
    qs = blocks[:, 4:]
    ints = torch.cat([qs & 0x0F, qs >> 4], dim=1).reshape(-1)  # ggml's order inside a block
    assert torch.equal(planar[:32] & 0x0F, ints[:32]) and torch.equal(planar[:32] >> 4, ints[32:])
    assert torch.equal(planar[32:36], blocks[:, 0:2].reshape(-1))
    assert torch.equal(planar[36:40], blocks[:, 2:4].reshape(-1))


def test_wrong_sizes_are_refused() -> None:
    raw = torch.zeros(BLOCK_TYPES["Q4_1"].nbytes((2, 64)), dtype=torch.uint8)
    with pytest.raises(ValueError, match="needs 80 bytes"):
        to_planar(raw[:-1], "Q4_1", (2, 64))
    with pytest.raises(ValueError, match="out of 127 weights"):
        dequantize_planar(raw, "Q4_1", (2, 64), out=torch.empty(127))


@pytest.mark.realmodel
def test_every_tensor_of_the_shipped_file() -> None:
    from tests.models.conftest import require_wheel

    require_wheel()
    from minions_local.models.smollm2 import shipped_gguf

    for tensor in gguf.GGUFReader(shipped_gguf()).tensors:
        name = tensor.tensor_type.name
        shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))
        want = reference(tensor.data, name).reshape(shape)
        raw = np.array(tensor.data).view(np.uint8)
        assert same_bits(planar_weights(raw, name, shape), want), tensor.name
