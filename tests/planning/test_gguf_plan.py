"""A GGUF target in a profile: its format passes through to the loader, and the memory
plan sizes its layers as the file's blocks (from the file, or from its quantization mix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from minions_local.core.errors import ProfileError
from minions_local.planning.memory_plan import plan_memory
from minions_local.profile import ModelDims, load_profile
from minions_local.profile.gguf_sizes import file_layer_bytes, mix_layer_bytes
from tests.profile.test_profiles import MINIMAL, write

GB = 1e9
LLAMA_70B = ModelDims(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=128256)


def test_q4_k_m_mix_sizes_llama_70b_as_llama_cpp_writes_it():
    """Meta-Llama-3.1-70B-Instruct-Q4_K_M.gguf is 42.52 GB (as listed by its publishers):
    the layers by llama.cpp's rule, plus a Q4_K embedding and a Q6_K head."""
    layers = mix_layer_bytes(LLAMA_70B, "Q4_K_M")
    embedding = LLAMA_70B.vocab * LLAMA_70B.hidden * 144 / 256
    head = LLAMA_70B.vocab * LLAMA_70B.hidden * 210 / 256
    assert abs(sum(layers) + embedding + head - 42.52 * GB) < 0.01 * 42.52 * GB
    assert len(set(layers)) == 2 and layers.count(max(layers)) == 40  # half the layers keep more bits
    assert mix_layer_bytes(LLAMA_70B, "Q4_0")[0] == min(layers)  # Q4_0 and Q4_K: both 4.5 bits a weight


def test_rtx4090_70b_gguf_streams_the_files_blocks_from_ram():
    plan = plan_memory(load_profile("rtx4090-70b-gguf"))
    int4 = plan_memory(load_profile("rtx4090-70b"))
    streamed = [b for t, b in zip(plan.layer_tiers, plan.layer_bytes) if t != "device"]
    assert set(plan.layer_tiers) == {"device", "ram"} and len(streamed) >= 60
    mean = sum(mix_layer_bytes(LLAMA_70B, "Q4_K_M")) / 80
    assert all(abs(b - mean) <= 1 for b in streamed)
    assert plan.buffers.bytes_each == max(mix_layer_bytes(LLAMA_70B, "Q4_K_M")) > mean
    # a resident GGUF layer is dequantized once into float16: more than 3x its blocks
    resident = [b for t, b in zip(plan.layer_tiers, plan.layer_bytes) if t == "device"]
    assert resident and resident[0] == LLAMA_70B.layer_bytes("none", "float16") > 3 * mean
    assert any(p.what.startswith("dequantization scratch") and p.bytes == resident[0] for p in plan.placements)
    assert plan.bytes_by_tier["device"] <= plan.budgets["device"]
    assert 1.05 < plan.streamed_bytes_per_pass / int4.streamed_bytes_per_pass  # Q4_K_M: ~4.8 bits, int4 ~4.5


def test_a_gguf_path_sets_the_format_and_our_quantization_is_refused(tmp_path):
    profile = load_profile(write(tmp_path, MINIMAL.format(target="m.gguf")))
    assert profile.target.format == "gguf"
    with pytest.raises(ProfileError, match="leave streamed_quantization"):
        load_profile(write(tmp_path, MINIMAL.format(target="m.gguf").replace(
            'path = "m.gguf"', 'path = "m.gguf"\nstreamed_quantization = "int4"')))
    with pytest.raises(ProfileError, match="gguf_mix describes a GGUF target"):
        load_profile(write(tmp_path, MINIMAL.format(target="m").replace('path = "m"', 'path = "m"\ngguf_mix = "Q4_0"')))


def test_an_absent_file_without_a_mix_says_what_to_set(tmp_path):
    with pytest.raises(ProfileError, match="set target.gguf_mix"):
        plan_memory(load_profile(write(tmp_path, MINIMAL.format(target="m.gguf"))))


def test_format_and_path_must_agree_for_the_loader(tmp_path):
    from minions_local.engine.from_profile import engine_kwargs_from_profile

    text = MINIMAL.format(target="folder").replace('path = "folder"', 'path = "folder"\nformat = "gguf"')
    with pytest.raises(ProfileError, match="is not a .gguf file"):
        engine_kwargs_from_profile(write(tmp_path, text))


def test_a_gguf_file_on_this_machine_is_planned_from_its_header(tmp_path, tokenizer, monkeypatch):
    pytest.importorskip("gguf")
    from minions_local.engine.from_profile import engine_kwargs_from_profile
    from minions_local.models.gguf_file import read_gguf
    from tests.helpers.tiny_gguf import write_gguf
    from tests.helpers.tiny_models import random_model, save, tiny_config

    config = tiny_config("llama", hidden=256)
    folder = save(random_model(config, seed=1), tmp_path / "llama", tokenizer)
    path = write_gguf(folder, tmp_path / "t.gguf", "Q4_K", types={"blk.0.ffn_down.weight": "Q6_K"})
    tensors = read_gguf(path).tensors
    want = [sum(t.nbytes for n, t in tensors.items() if n.startswith(f"blk.{i}."))
            for i in range(config.num_hidden_layers)]
    assert file_layer_bytes(Path(path), config.num_hidden_layers) == want and want[0] > want[1]
    text = MINIMAL.format(target=path).replace('host_ram_gb = 2', 'host_ram_gb = 2\ndisk_budget_gb = 1')
    text = text.replace('[target.dims]', 'tier = "disk"\nresident_layers = 0\n[target.dims]')
    profile_path = write(tmp_path, text.split("[target.dims]")[0])
    plan = plan_memory(load_profile(profile_path))
    assert plan.target_dims.layers == config.num_hidden_layers
    assert plan.buffers.bytes_each == max(want)
    assert abs(plan.streamed_bytes_per_pass - sum(want)) < len(want)
    kwargs = engine_kwargs_from_profile(profile_path)
    assert kwargs["stream_options"]["quant"] == "gguf" and kwargs["target"] == str(path)


def test_on_a_cpu_the_int4_kernels_form_sizes_4bit_layers():
    """The int4 kernel holds 32 weights in 20 bytes: Q4_1's size, a ninth more than Q4_0's;
    a mix with Q6_K tensors is never held that way (offload/gguf_streamed._uses_int4)."""
    from minions_local.profile.gguf_sizes import gguf_layer_bytes

    for mix, grows in (("Q4_0", True), ("Q4_1", False), ("Q4_K_M", False), ("Q8_0", False)):
        plain = gguf_layer_bytes(None, mix, LLAMA_70B)
        held = gguf_layer_bytes(None, mix, LLAMA_70B, int4=True)
        assert held == ([b * 10 // 9 for b in plain] if grows else plain), mix
