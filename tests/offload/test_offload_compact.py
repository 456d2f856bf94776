"""The streamed target on the compact forward: transformers' logits bit for bit, with
the layers taken from the same prefetch pipeline and the fused weights as buffer views."""

from __future__ import annotations

import pytest
import torch

from minions_local.backends import hf_target
from minions_local.backends.compact_streamed import stacked
from minions_local.backends.hf_target import CompactTarget, HFTarget, StreamedCompactTarget, exact_target
from minions_local.offload import load_streamed_causal_lm
from minions_local.core.tree import TokenTree
from tests.helpers.rows import assert_rows_are_one_token_passes
from tests.helpers.offload_helpers import one_thread, save_tiny


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _tree(root: int) -> tuple[TokenTree, int]:
    tree = TokenTree.from_root(root)
    a = tree.add(0, 7)
    tree.add(0, 8)
    tree.add(a, 9)
    tree.add(tree.add(a, 10), 11)
    return tree, a


def _reference(model):
    """What the target must equal bit for bit: transformers' logits in float32; in bf16
    the row-invariant compact forward's, as exact_target gives it on an untouched copy."""
    return exact_target(model, release_weights=False)


def _streamed(path, cache, dtype, **kw):
    model, stats = load_streamed_causal_lm(path, dtype=dtype, cache_dir=cache, buffers=2, **kw)
    return model, stats


@pytest.mark.parametrize("arch, dtype, quant, layer_tiers", [
    ("llama", torch.bfloat16, "none", None),
    ("llama", torch.float32, "none", None),
    ("qwen2", torch.bfloat16, "none", None),  # q/k/v biases, fused like the weights
    ("llama", torch.bfloat16, "int8", ["disk", "device", "disk"]),  # dequantized + resident packed
    ("qwen2", torch.float32, "int4", ["device", "disk", "disk"]),
])
def test_streamed_compact_target_is_exact(tmp_path, arch, dtype, quant, layer_tiers):
    path = save_tiny(tmp_path, arch, layers=3)
    ref_model, _ = _streamed(path, tmp_path / "a", dtype, tier="disk", quant=quant, layer_tiers=layer_tiers)
    model, stats = _streamed(path, tmp_path / "b", dtype, tier="disk", quant=quant, layer_tiers=layer_tiers)
    ref = HFTarget(ref_model)
    # (kept: a second compact wrapper is built on the same model below)
    target = exact_target(model, bytes_streamed=lambda: stats.bytes_streamed, release_weights=False)
    # On this project's machines the check at load time picks the compact forward, and
    # it is row-invariant in every dtype (float32 too: oneDNN's matmuls, not MKL's).
    assert isinstance(target, StreamedCompactTarget)
    assert target.cache_len == 0 and target.cached == []
    bf16 = dtype == torch.bfloat16
    assert target.decoder.row_invariant
    compact = StreamedCompactTarget(model, bytes_streamed=lambda: stats.bytes_streamed)
    context = list(range(3, 60))
    tree, a = _tree(context[-1])
    before = stats.bytes_streamed
    for n in (20, 57):  # the second verify runs on the cache the first one left
        expected, got = ref.verify(context[:n], tree), target.verify(context[:n], tree)
        assert torch.allclose(expected, got, atol=0.05 if bf16 else 1e-4)
        assert torch.allclose(expected, compact.verify(context[:n], tree), atol=1e-2 if bf16 else 1e-5)
        for t in (ref, target, compact):
            t.commit(tree, [0, a])
    assert stats.bytes_streamed > before  # the layers really streamed through the pipeline
    assert_rows_are_one_token_passes(target, context, tree)


def test_fused_weights_are_views_of_the_layer_buffer(tmp_path):
    """storage_order puts q/k/v and gate/up back to back, so no pass copies weights."""
    path = save_tiny(tmp_path, "qwen2", layers=2)
    model, stats = _streamed(path, tmp_path / "c", torch.bfloat16, tier="disk")
    decoder = StreamedCompactTarget(model, bytes_streamed=lambda: stats.bytes_streamed).decoder
    store = decoder.store
    decoder.store.begin_pass()
    fused = decoder._layer(0)
    buffers = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in store.buffers]
    for name in ("qkv", "qkv_bias", "gate_up"):
        ptr = fused[name].data_ptr()
        assert any(lo <= ptr < hi for lo, hi in buffers), name
    decoder._done(0)
    store.drain()


def test_stacked_is_a_view_only_when_the_parts_touch():
    flat = torch.arange(24.0)
    parts = [flat[0:8].view(2, 4), flat[8:16].view(2, 4), flat[16:24].view(2, 4)]
    view = stacked(parts)
    assert view.data_ptr() == flat.data_ptr() and torch.equal(view, flat.view(6, 4))
    apart = [flat[0:8].view(2, 4), flat[12:20].view(2, 4)]
    copy = stacked(apart)
    assert torch.equal(copy, torch.cat(apart)) and copy.data_ptr() != flat.data_ptr()


def test_streamed_target_falls_back_to_transformers_where_not_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_target, "_row_invariant", lambda reference, compact, vocab: False)
    path = save_tiny(tmp_path, "llama", layers=2)
    model, stats = _streamed(path, tmp_path / "d", torch.bfloat16, tier="disk")
    target = exact_target(model, bytes_streamed=lambda: stats.bytes_streamed)
    assert type(target) is HFTarget
    assert target.bytes_streamed() == stats.bytes_streamed


def test_streaming_is_where_the_layers_live_not_how_the_model_was_loaded(tmp_path):
    """The streaming loader with every layer on the device: the resident compact forward."""
    path = save_tiny(tmp_path, "llama", layers=2)
    ref_model, _ = _streamed(path, tmp_path / "i", torch.bfloat16, tier="device")
    model, stats = _streamed(path, tmp_path / "j", torch.bfloat16, tier="device")
    target = exact_target(model, bytes_streamed=lambda: stats.bytes_streamed)
    assert type(target) is CompactTarget
    context = list(range(3, 40))
    tree, _ = _tree(context[-1])
    assert torch.equal(_reference(ref_model).verify(context, tree), target.verify(context, tree))


def test_resident_parts_are_held_once(tmp_path):
    """Resident layers (fused at load) and an untied, prepacked lm_head drop the
    modules' copies; streamed layers keep their bindings and the logits do not move."""
    path = save_tiny(tmp_path, "llama", layers=3)
    tiers = ["disk", "device", "disk"]
    ref_model, _ = _streamed(path, tmp_path / "e", torch.bfloat16, tier="disk", layer_tiers=tiers)
    model, stats = _streamed(path, tmp_path / "f", torch.bfloat16, tier="disk", layer_tiers=tiers)
    target = exact_target(model, bytes_streamed=lambda: stats.bytes_streamed)
    assert isinstance(target, StreamedCompactTarget)
    resident = model.model.layers[1]
    assert resident.self_attn.q_proj.weight.numel() == 0 and resident.mlp.up_proj.weight.numel() == 0
    assert resident.self_attn.o_proj.weight.numel() > 0  # used as it is, not copied
    if target.decoder.lm_head is not model.lm_head.weight:  # prepacked here: the plain one is gone
        assert model.lm_head.weight.numel() == 0
    context = list(range(3, 40))
    tree, _ = _tree(context[-1])
    assert torch.equal(_reference(ref_model).verify(context, tree), target.verify(context, tree))


@pytest.mark.parametrize("layer", [0, 1])
def test_a_pass_interrupted_inside_a_layer_leaves_the_target_exact(tmp_path, monkeypatch, layer):
    """Ctrl-C while a layer holds its buffer (fetched, never given back): the next
    pass starts the pipeline over and the logits are still transformers' own."""
    from minions_local.offload.binding import layer_weights

    path = save_tiny(tmp_path, "llama", layers=3)
    ref_model, _ = _streamed(path, tmp_path / "g", torch.bfloat16, tier="disk")
    model, stats = _streamed(path, tmp_path / "h", torch.bfloat16, tier="disk")
    target = exact_target(model, bytes_streamed=lambda: stats.bytes_streamed)
    weights = layer_weights(model.model.layers[layer])
    real, calls = weights.enter, []

    def enter_then_interrupt():
        real()
        calls.append(1)
        if len(calls) == 2:  # the second pass: the verify after a good prefill
            raise KeyboardInterrupt

    monkeypatch.setattr(weights, "enter", enter_then_interrupt)
    context = list(range(3, 40))
    tree, a = _tree(context[-1])
    with pytest.raises(KeyboardInterrupt):
        target.verify(context, tree)
    ref = _reference(ref_model)
    for _ in range(2):
        assert torch.equal(ref.verify(context, tree), target.verify(context, tree))
        ref.commit(tree, [0, a])
        target.commit(tree, [0, a])
        context = context + [7]
