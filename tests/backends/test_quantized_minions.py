"""bitsandbytes minions (nf4/int8): loaded through the same path a profile uses."""

import pytest
from transformers import AutoModelForCausalLM

from minions_local import Engine
from minions_local.engine.loading import MinionSpec
from tests.helpers.tiny_models import hf_greedy

bnb = pytest.importorskip("bitsandbytes")


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_quantized_minion_keeps_output_identical(families, quantization):
    fam = families["llama"]
    spec = MinionSpec(str(fam["close"]), name="close-q", quantization=quantization, device="cpu",
                      dtype="float32")
    engine = Engine.from_pretrained(fam["target"], [spec], budget=8)
    assert engine.minion_names == ["close-q"]
    minion = engine.minions[0]
    assert type(minion.runner).__name__ == "CachedModel"  # bnb layers run their own kernels
    reference = AutoModelForCausalLM.from_pretrained(fam["target"]).eval()
    prompt = [4, 9, 16, 25]
    out = engine.generate(prompt, max_new_tokens=24)
    assert out.token_ids == hf_greedy(reference, prompt, 24)
    assert max(s.accepted for s in out.steps) >= 2
