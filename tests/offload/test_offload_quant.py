"""Quantized streaming runs exactly the model with the same dequantized weights."""

from __future__ import annotations

import pytest
import torch

from minions_local.offload import load_streamed_causal_lm
from minions_local.offload.layout import plan_layout
from minions_local.offload.quant import apply_dequantized_weights_, dequantize, dequantize_weight, quantize_weight
from tests.helpers.offload_helpers import max_diff, one_thread, resident, save_tiny, tree_pass_logits


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("models"), "qwen2")  # q/k/v biases stay unquantized


@pytest.mark.parametrize("mode, tol", [("int8", 0.005), ("int4", 0.08)])
def test_quantization_round_trip_error_is_small(mode, tol):
    w = torch.randn(96, 256)
    err = (dequantize_weight(w, mode, torch.float32) - w).abs().max() / w.abs().max()
    assert 0 < err <= tol


def test_int4_packs_two_values_per_byte_with_group_scales():
    w = torch.randn(8, 128)
    pieces = quantize_weight(w, "int4", torch.float16)
    assert pieces["q"].shape == (8, 64) and pieces["q"].dtype == torch.uint8
    assert pieces["scale"].shape == (8, 2) and pieces["scale"].dtype == torch.float16
    out = torch.empty(8, 128, dtype=torch.float16)
    dequantize(pieces["q"], pieces["scale"], "int4", out)
    assert torch.equal(out, dequantize_weight(w, "int4", torch.float16))


def test_quantized_layout_is_smaller():
    shapes = {"mlp.down_proj.weight": (4096, 11008), "input_layernorm.weight": (4096,)}
    full = plan_layout(shapes, "none", torch.bfloat16).nbytes
    assert plan_layout(shapes, "int8", torch.bfloat16).nbytes / full == pytest.approx(0.5, abs=0.01)
    assert plan_layout(shapes, "int4", torch.bfloat16).nbytes / full == pytest.approx(0.265, abs=0.01)
    # bf16 weights under float32 math move the bytes of a bf16 model, not of a float32 one.
    assert plan_layout(shapes, "bf16", torch.float32).nbytes == pytest.approx(full, rel=0.001)


def test_bf16_storage_widens_exactly_to_float32():
    w = torch.randn(96, 256)
    stored = quantize_weight(w, "bf16", torch.float32)
    assert set(stored) == {"q"} and stored["q"].dtype == torch.bfloat16
    out = dequantize(stored["q"], None, "bf16", torch.empty(96, 256))
    assert torch.equal(out, w.to(torch.bfloat16).float())
    assert torch.equal(dequantize_weight(w, "bf16", torch.float32), out)


@pytest.mark.parametrize("quant", ["int8", "int4", "bf16"])
def test_quantized_streaming_matches_dequantized_reference(qwen, tmp_path, quant):
    ref = tree_pass_logits(apply_dequantized_weights_(resident(qwen), quant))
    plain = tree_pass_logits(resident(qwen))
    full = load_streamed_causal_lm(qwen, tier="ram", dtype=torch.float32)[1].bytes_per_pass
    for tiers in (["disk"] * 4, ["ram", "device", "disk", "ram"]):
        model, stats = load_streamed_causal_lm(qwen, layer_tiers=tiers, quant=quant, dtype=torch.float32,
                                               cache_dir=tmp_path)
        got = tree_pass_logits(model)
        assert max_diff(got, ref) <= 1e-5
        assert max_diff(got, plain) > 1e-4  # really quantized
    fp32_three_layers = full * 3 / 4  # the mixed plan streams 3 of the 4 layers
    assert stats.bytes_per_pass / fp32_three_layers < {"int8": 0.3, "int4": 0.16, "bf16": 0.55}[quant]


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_detour_gives_the_same_bits_as_the_16bit_path(mode, dtype):
    """CPU dequantizes through float32, CUDA in place: both must give identical weights."""
    from minions_local.offload.quant import _dequantize_into

    pieces = quantize_weight(torch.randn(64, 256) * 0.05, mode, dtype)
    direct = _dequantize_into(pieces["q"], pieces["scale"].to(dtype), mode, torch.empty(64, 256, dtype=dtype))
    detour = dequantize(pieces["q"], pieces["scale"], mode, torch.empty(64, 256, dtype=dtype))
    assert torch.equal(direct, detour)
