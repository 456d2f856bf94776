"""The engine with a streamed target (RAM/disk tiers): the same greedy tokens as the
resident target alone, and bytes streamed per step only where layers do stream.
(What each tier holds, byte for byte, is test_memory.py's.)"""

import pytest
from transformers import AutoModelForCausalLM

from minions_local import Engine
from minions_local.offload.quant import apply_dequantized_weights_
from tests.helpers.tiny_models import hf_greedy

PROMPTS = [[5, 17, 33, 9], [40, 2, 71, 71, 8, 13, 60]]


@pytest.mark.parametrize("arch, quant, layer_tiers", [("llama", "none", None), ("qwen2", "none", None),
                                                      ("llama", "int8", ["disk", "device", "disk"])])
def test_disk_tier_engine_matches_the_target_alone(families, tmp_path, arch, quant, layer_tiers):
    fam = families[arch]
    target = apply_dequantized_weights_(AutoModelForCausalLM.from_pretrained(fam["target"]).eval(), quant)
    options = {"cache_dir": tmp_path, "quant": quant, "buffers": 2, "layer_tiers": layer_tiers}
    engine = Engine.from_pretrained(fam["target"], [fam["close"], fam["shallow"]], dtype="float32",
                                    target_tier="disk", budget=16, max_depth=6, stream_options=options)
    for prompt in PROMPTS:
        out = engine.generate(prompt, max_new_tokens=24)
        assert out.token_ids == hf_greedy(target, prompt, 24)
        assert all(s.bytes_streamed > 0 for s in out.steps)


def test_ram_tier_on_cpu_is_resident(families):
    fam = families["mistral"]
    engine = Engine.from_pretrained(fam["target"], [fam["close"]], target_tier="ram")
    out = engine.generate([5, 6, 7], max_new_tokens=5)
    assert all(s.bytes_streamed == 0 for s in out.steps)
