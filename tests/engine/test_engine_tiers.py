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


@pytest.mark.parametrize("native", [True, False])
def test_streamed_bf16_weights_get_float32_math_only_where_the_cpu_lacks_bf16_kernels(families, tmp_path,
                                                                                     monkeypatch, native):
    """Without bf16 matmul kernels a bf16 tree pass costs about a 1-token pass per row,
    so "auto" computes a streamed bf16 target in float32: its layers still move as bf16
    (the same bytes per pass), and it decodes exactly as transformers does in float32
    on the bf16-rounded weights."""
    import torch

    from minions_local.offload import dtypes

    monkeypatch.setattr(dtypes, "cpu_has_bf16_matmul", lambda: native)
    fam = families["llama"]
    options = {"cache_dir": tmp_path, "buffers": 2}
    engine = Engine.from_pretrained(fam["target"], [fam["close"]], dtype="bfloat16", target_tier="disk",
                                    budget=16, max_depth=6, stream_options=options)
    target = engine.decoder.target
    assert target.model.dtype == (torch.bfloat16 if native else torch.float32)
    forced = Engine.from_pretrained(fam["target"], [], dtype="bfloat16", compute_dtype="bfloat16",
                                    target_tier="disk", stream_options=options)
    assert forced.decoder.target.model.dtype == torch.bfloat16
    # The same bytes per pass but for the norms, which float32 math stores in float32.
    assert target.stream_stats.bytes_per_pass == pytest.approx(forced.decoder.target.stream_stats.bytes_per_pass,
                                                               rel=0.01)
    if not native:
        reference = AutoModelForCausalLM.from_pretrained(fam["target"], dtype=torch.bfloat16).float().eval()
        for prompt in PROMPTS:
            assert engine.generate(prompt, max_new_tokens=24).token_ids == hf_greedy(reference, prompt, 24)
    resident = Engine.from_pretrained(fam["target"], [], dtype="bfloat16", target_tier="device")
    assert resident.decoder.target.model.dtype == torch.bfloat16  # "auto" widens streamed targets only
