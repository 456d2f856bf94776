"""memory_by_tier() says where an engine's weights are, byte for byte, in each tier."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from minions_local import Engine


def _bytes(model, part: str = "") -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if part in n)


@pytest.fixture(scope="module")
def reference(families):
    return AutoModelForCausalLM.from_pretrained(families["llama"]["target"])


@pytest.mark.parametrize("tier", ["device", "ram"])
def test_a_resident_target_is_all_on_the_device(families, reference, tier):
    # On a CPU the compute device is host RAM, so the 'ram' tier loads resident too.
    engine = Engine.from_pretrained(families["llama"]["target"], [], dtype="float32", target_tier=tier)
    assert engine.memory_by_tier() == {"device": _bytes(reference)}


def test_a_disk_target_keeps_its_layers_on_disk_and_its_buffers_on_the_device(families, reference, tmp_path):
    engine = Engine.from_pretrained(families["llama"]["target"], [], dtype="float32", target_tier="disk",
                                    stream_options={"cache_dir": tmp_path, "buffers": 2})
    tiers = engine.memory_by_tier()
    layers, one_layer = _bytes(reference, ".layers."), _bytes(reference, ".layers.0.")
    assert set(tiers) == {"device", "disk"}
    assert tiers["disk"] == layers
    buffers = tiers["device"] - (_bytes(reference) - layers)  # embedding, final norm and head stay resident
    assert 2 * one_layer <= buffers < 2 * (one_layer + 4096)  # two layer buffers, block-aligned


def test_model_minions_count_on_the_device(families, reference):
    fam = families["llama"]
    minion = AutoModelForCausalLM.from_pretrained(fam["close"])
    engine = Engine.from_pretrained(fam["target"], [fam["close"], "ngram"], dtype="float32")
    assert engine.memory_by_tier() == {"device": _bytes(reference) + _bytes(minion)}


@pytest.mark.parametrize("profile, widens", [("cpu-demo-disk", True), ("cpu-demo", False)])
def test_the_plan_holds_kv_cache_and_head_in_the_math_dtype(monkeypatch, profile, widens):
    """A streamed bf16 target computing in float32 (no bf16 matmul kernels) holds its KV
    cache and its embeddings + head in float32: the plan counts them so, and its layers
    at bf16 all the same. A resident target is not widened."""
    from minions_local.engine.from_profile import engine_kwargs_from_profile
    from minions_local.offload import dtypes

    def planned(native: bool) -> dict[str, int]:
        monkeypatch.setattr(dtypes, "cpu_has_bf16_matmul", lambda: native)
        plan = engine_kwargs_from_profile(profile)["memory_plan"]
        return {p.what: p.bytes for p in plan.placements}

    native, widened = planned(True), planned(False)
    factor = 2 if widens else 1
    assert widened["KV cache target"] == factor * native["KV cache target"]
    assert widened["embeddings + head (tied)"] == factor * native["embeddings + head (tied)"]
    assert {k: v for k, v in widened.items() if "layer" in k} == {k: v for k, v in native.items() if "layer" in k}
