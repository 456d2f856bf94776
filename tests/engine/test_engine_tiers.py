"""The streamed target (RAM/disk tiers) gives the same tokens as the resident one."""

import pytest
from transformers import AutoModelForCausalLM

from minions_local import Engine
from tests.helpers.tiny_models import hf_greedy


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_disk_tier_greedy_identity(families, arch, tmp_path):
    fam = families[arch]
    reference = AutoModelForCausalLM.from_pretrained(fam["target"]).eval()
    engine = Engine.from_pretrained(fam["target"], [fam["close"], fam["shallow"]], target_tier="disk",
                                    budget=16, stream_options={"cache_dir": tmp_path})
    for prompt in ([3, 4, 5], [40, 41, 42, 43, 44, 45]):
        out = engine.generate(prompt, max_new_tokens=30)
        assert out.token_ids == hf_greedy(reference, prompt, 30)
    assert all(s.bytes_streamed > 0 for s in out.steps)
    assert engine.memory_by_tier()


def test_ram_tier_on_cpu_is_resident(families):
    fam = families["mistral"]
    engine = Engine.from_pretrained(fam["target"], [fam["close"]], target_tier="ram")
    out = engine.generate([5, 6, 7], max_new_tokens=5)
    assert all(s.bytes_streamed == 0 for s in out.steps)
