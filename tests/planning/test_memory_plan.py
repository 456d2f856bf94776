"""The memory planner: sane placements for the shipped profiles, clear errors otherwise."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from minions_local.core.errors import MemoryPlanError
from minions_local.planning.memory_plan import plan_memory
from minions_local.profile import ModelDims, load_profile

GB = 1e9


def test_rtx4090_70b_streams_the_4bit_layers_that_do_not_fit():
    plan = plan_memory(load_profile("rtx4090-70b"))
    assert len(plan.layer_tiers) == 80
    assert 35 * GB <= plan.target_layer_bytes <= 40 * GB  # 4-bit 70B: ~0.53 bytes/param
    assert plan.streamed_bytes_per_pass == plan.target_layer_bytes - plan.resident_layer_bytes
    assert 15 * GB < plan.streamed_bytes_per_pass < 30 * GB
    assert 20 <= plan.resident_layers <= 40
    # resident layers first, then the RAM tier; nothing on disk with 64 GB of RAM
    assert plan.layer_tiers == ["device"] * plan.resident_layers + ["ram"] * (80 - plan.resident_layers)
    assert plan.buffers.count == 2 and plan.buffers.bytes_each == plan.layer_bytes[-1]
    used = plan.bytes_by_tier
    assert used["device"] <= plan.budgets["device"]
    assert used["device"] > plan.budgets["device"] - plan.layer_bytes[0]  # filled, no layer left out
    assert used["ram"] <= plan.budgets["ram"]
    assert plan.embeddings_tier == "device"  # where offload/streamed.py keeps them
    assert set(plan.minion_bytes) == {"Llama-3.2-1B-Instruct", "Llama-3.2-3B-Instruct", "ngram"}
    assert 0.8 * GB < plan.minion_bytes["Llama-3.2-1B-Instruct"] < 1.3 * GB  # nf4 + bf16 embeddings
    assert plan.minion_bytes["ngram"] == 0
    text = plan.format()
    assert "0-" in text and "ram" in text and "streamed per pass" in text


def test_70b_parameter_count_from_known_dims():
    dims = plan_memory(load_profile("rtx4090-70b")).target_dims
    assert abs(dims.params - 70.6e9) / 70.6e9 < 0.01
    assert dims.kv_bytes_per_token("float16") == 2 * 80 * 8 * 128 * 2


def test_demo_profiles():
    ram = plan_memory(load_profile("stdlib-demo"))
    assert set(ram.layer_tiers) == {"device"} and ram.streamed_bytes_per_pass == 0
    assert ram.buffers.count == 0
    disk = plan_memory(load_profile("stdlib-demo-disk"))
    assert set(disk.layer_tiers) == {"disk"}
    assert disk.streamed_bytes_by_tier["disk"] == disk.target_layer_bytes
    assert disk.buffers.count == 6


def test_config_json_wins_over_known_dims(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    config = {"num_hidden_layers": 3, "hidden_size": 128, "intermediate_size": 256,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
    (folder / "config.json").write_text(json.dumps(config))
    plan = plan_memory(load_profile("stdlib-demo", target=str(folder)))
    assert plan.target_dims == ModelDims(layers=3, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=1000)
    assert len(plan.layer_tiers) == 3


def _profile(name, **changes):
    profile = load_profile(name)
    for dotted, value in changes.items():
        section, field = dotted.split("__")
        setattr(getattr(profile, section), field, value)
    return profile


def test_device_too_small_for_the_minimum_says_what_to_change():
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(_profile("rtx4090-70b", hardware__device_memory_gb=6.0))
    text = str(err.value)
    assert "before any target layer" in text and "device_memory_gb = 6.0" in text
    assert "layer_buffers" in text and "context_tokens" in text and "GB" in text


def test_device_tier_that_cannot_hold_the_target():
    with pytest.raises(MemoryPlanError, match="tier = 'device' needs all 80 layers"):
        plan_memory(_profile("rtx4090-70b", target__tier="device"))


def test_ram_tier_too_small_suggests_disk():
    with pytest.raises(MemoryPlanError, match="set target.tier = 'disk'"):
        plan_memory(_profile("rtx4090-70b", hardware__host_ram_gb=16.0))


def test_disk_tier_fills_ram_first_then_needs_disk_budget():
    profile = _profile("rtx4090-70b", hardware__host_ram_gb=16.0, target__tier="disk")
    with pytest.raises(MemoryPlanError, match="disk_budget_gb"):
        plan_memory(profile)
    profile.hardware.disk_budget_gb = 100.0
    plan = plan_memory(profile)
    assert {"device", "ram", "disk"} == set(plan.layer_tiers)
    assert plan.bytes_by_tier["ram"] <= 16 * GB
    assert any(p.what == "disk staging buffers" for p in plan.placements)


def test_resident_layer_cap():
    plan = plan_memory(_profile("rtx4090-70b", target__resident_layers=5))
    assert plan.resident_layers == 5
    assert plan_memory(_profile("rtx4090-70b", target__resident_layers=0)).resident_layers == 0


def test_streamed_quantization_sets_bytes_per_pass():
    int4 = plan_memory(_profile("rtx4090-70b", target__resident_layers=0))
    int8 = plan_memory(_profile("rtx4090-70b", target__resident_layers=0, target__streamed_quantization="int8",
                                hardware__host_ram_gb=128.0))
    assert 1.8 < int8.streamed_bytes_per_pass / int4.streamed_bytes_per_pass < 2.0


def test_planning_imports_no_torch():
    code = ("import sys; from minions_local.planning.cli import plan_report; plan_report('rtx4090-70b'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gguf_minion_sizes_come_from_the_file(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "small.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_context_length(256)
    w.add_vocab_size(100)
    w.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    profile = load_profile("stdlib-demo", minions=[str(path), "ngram"])
    plan = plan_memory(profile)
    assert plan.minion_dims["small"] == ModelDims(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2,
                                                  vocab=100, tied_embeddings=True, max_context=256)
    assert plan.minion_bytes["small"] == path.stat().st_size


def test_cli_reports_a_profile_that_cannot_fit(tmp_path, capsys):
    from minions_local.planning.cli import main
    from minions_local.profile.loader import shipped_dir

    text = (shipped_dir() / "rtx4090-70b.toml").read_text().replace("device_memory_gb = 24.0", "device_memory_gb = 4.0")
    path = tmp_path / "small-card.toml"
    path.write_text(text)
    assert main(["--plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "device_memory_gb = 4.0" in err and "Change one of" in err and "Traceback" not in err
    assert main(["--plan", "cpu-demo.toml"]) == 0  # the shipped file by its file name


def test_the_plan_counts_the_caches_of_concurrent_requests():
    """Continuous batching: each request holds its own KV caches (target and minions);
    the plan says how much and how many fit beside everything else."""
    from minions_local.planning.memory_plan import plan_memory
    from minions_local.profile import load_profile

    cpu = plan_memory(load_profile("cpu-demo-disk"))
    caches = [p for p in cpu.placements if p.what.startswith("KV cache")]
    assert len(caches) == 2 and cpu.kv_per_request == sum(p.bytes for p in caches)
    room = cpu.budgets["device"] - cpu.bytes_by_tier["device"]
    assert cpu.requests_that_fit == 1 + room // cpu.kv_per_request > 8
    assert f"{cpu.requests_that_fit} fit" in cpu.format()
    gpu = plan_memory(load_profile("rtx4090-70b"))  # resident layers fill the card: room for one
    assert gpu.requests_that_fit == 1 and "resident layers)" in gpu.format()
