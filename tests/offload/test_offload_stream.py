"""Streamed target == resident target, over a token tree with a 4D mask and a cache."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

from minions_local.core.errors import MemoryPlanError
from minions_local.offload import load_streamed_causal_lm
from minions_local.offload import binding
from minions_local.offload import streamed as streamed_mod
from tests.helpers.offload_helpers import max_diff, one_thread, resident, save_tiny, tree_pass_logits


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: save_tiny(root, arch) for arch in ("llama", "qwen2", "mistral")}


@pytest.fixture(scope="module")
def reference(models):
    return {arch: tree_pass_logits(resident(path)) for arch, path in models.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_streamed_logits_equal_resident(models, reference, tmp_path, arch, tier):
    model, stats = load_streamed_causal_lm(models[arch], tier=tier, dtype=torch.float32, cache_dir=tmp_path)
    assert max_diff(tree_pass_logits(model), reference[arch]) <= 1e-5
    assert stats.bytes_per_pass > 0
    assert stats.bytes_streamed == 3 * stats.bytes_per_pass  # prefill + two tree passes
    assert stats.read_mode in (("o_direct", "fadvise") if tier == "disk" else ("",))
    assert not stats.warnings


@pytest.mark.parametrize("buffers", [1, 2, 4])  # 3 streamed layers: 2 wraps mid-pass
def test_mixed_layer_tiers(models, reference, tmp_path, buffers):
    tiers = ["disk", "device", "ram", "disk"]
    model, stats = load_streamed_causal_lm(models["llama"], tier="ram", layer_tiers=tiers, buffers=buffers,
                                           dtype=torch.float32, cache_dir=tmp_path)
    assert max_diff(tree_pass_logits(model), reference["llama"]) <= 1e-5
    per_layer = stats.bytes_per_pass // 3
    assert stats.bytes_per_pass == 3 * per_layer
    stats.reset()
    assert stats.bytes_streamed == 0 and stats.passes == 0
    tree_pass_logits(model, steps=1)
    assert stats.bytes_streamed == 2 * stats.bytes_per_pass
    assert stats.passes == 2


def test_progress_reports_every_layer(models, tmp_path):
    events = []
    load_streamed_causal_lm(models["llama"], layer_tiers=["disk", "ram", "device", "disk"], cache_dir=tmp_path,
                            progress=events.append)
    assert {e.tier for e in events} == {"disk", "ram", "device"}
    assert any("packing layer 3" in e.message for e in events)
    assert events[-1].done_bytes == events[-1].total_bytes > 0
    assert all(e.model == "target" for e in events)


def test_all_device_tier_is_plain_resident(models, reference, tmp_path):
    model, stats = load_streamed_causal_lm(models["qwen2"], tier="device", dtype=torch.float32)
    assert max_diff(tree_pass_logits(model), reference["qwen2"]) <= 1e-5
    assert stats.bytes_per_pass == 0 and stats.bytes_streamed == 0


def test_tied_embeddings_and_bf16(tmp_path):
    path = save_tiny(tmp_path, "qwen2", tie=True)
    ref = tree_pass_logits(resident(path, torch.bfloat16))
    model, _ = load_streamed_causal_lm(path, tier="disk", dtype="bf16", cache_dir=tmp_path / "cache")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert max_diff(tree_pass_logits(model), ref) == 0.0


def test_parameters_are_released_between_passes(models, tmp_path):
    model, _ = load_streamed_causal_lm(models["llama"], tier="ram", dtype=torch.float32)
    tree_pass_logits(model, steps=0)
    for layer in model.model.layers:
        assert all(p.numel() == 0 for p in layer.parameters())
    assert model.model.embed_tokens.weight.numel() > 0


def test_streaming_state_lives_beside_the_model_not_on_it(models, tmp_path):
    """Nothing is set on transformers' objects, and a dropped model takes its layer
    store (threads, buffers) and its layers' weight bindings with it."""
    model, _ = load_streamed_causal_lm(models["llama"], tier="disk", layer_tiers=["disk", "device", "ram", "disk"],
                                       quant="int8", dtype=torch.float32, cache_dir=tmp_path)
    layers = list(model.model.layers)
    store = binding.layer_store(model)
    assert store is not None and all(binding.layer_weights(layer) is not None for layer in layers)
    tree_pass_logits(model, steps=0)
    ours = {type(store), *(type(binding.layer_weights(layer)) for layer in layers)}
    for module in model.modules():
        assert not any(type(value) in ours for value in vars(module).values())
    gone = [weakref.ref(obj) for obj in (model, store, *layers, *map(binding.layer_weights, layers))]
    del model, layers, store
    gc.collect()
    assert [ref() for ref in gone] == [None] * len(gone)


def test_pass_after_an_aborted_pass(models, reference, tmp_path):
    """A pass that dies midway (here: a bad input) must not poison the next one."""
    model, _ = load_streamed_causal_lm(models["llama"], tier="disk", dtype=torch.float32, cache_dir=tmp_path)
    layer = model.model.layers[2]
    handle = layer.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        tree_pass_logits(model, steps=0)
    handle.remove()
    assert max_diff(tree_pass_logits(model), reference["llama"]) <= 1e-5


def test_falls_back_to_disk_with_a_visible_warning(models, reference, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(streamed_mod, "available_ram", lambda: streamed_mod.RAM_MARGIN + 700_000)
    with caplog.at_level(logging.WARNING):
        model, stats = load_streamed_causal_lm(models["llama"], tier="ram", dtype=torch.float32, cache_dir=tmp_path)
    assert stats.warnings and "stream from 'disk'" in stats.warnings[0]
    assert any("stream from 'disk'" in r.getMessage() for r in caplog.records)
    assert stats.read_mode in ("o_direct", "fadvise")
    assert max_diff(tree_pass_logits(model), reference["llama"]) <= 1e-5


def test_bad_plans_are_explained(models):
    with pytest.raises(MemoryPlanError, match="4 decoder layers"):
        load_streamed_causal_lm(models["llama"], layer_tiers=["ram"] * 3)
    with pytest.raises(MemoryPlanError, match="unknown tier"):
        load_streamed_causal_lm(models["llama"], layer_tiers=["ram", "ram", "ssd", "ram"])
    with pytest.raises(MemoryPlanError, match="at least one layer buffer"):
        load_streamed_causal_lm(models["llama"], buffers=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant", ["none", "int4"])
def test_cuda_streaming_equals_resident(models, tmp_path, quant):
    from minions_local.offload.quant import apply_dequantized_weights_

    ref_model = apply_dequantized_weights_(resident(models["llama"]), quant).to("cuda")
    ref = tree_pass_logits(ref_model)
    for tiers in (["ram"] * 4, ["disk"] * 4, ["disk", "device", "ram", "disk"]):
        model, stats = load_streamed_causal_lm(models["llama"], layer_tiers=tiers, dtype=torch.float32,
                                               device="cuda", quant=quant, cache_dir=tmp_path)
        got = tree_pass_logits(model)
        assert max_diff(got, ref) <= 1e-4
        assert stats.bytes_streamed > 0

