"""A config.json that disagrees with the weights, or a damaged weights file, is refused
with a message naming the file and the numbers, on every way a model is loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minions_local.backends.hf import load_causal_lm
from minions_local.core.errors import ModelLoadError
from minions_local.engine import Engine
from minions_local.offload.streamed import load_streamed_causal_lm
from tests.helpers.tiny_models import random_model, save, tiny_config


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory) -> Path:
    return save(random_model(tiny_config("llama", layers=6), 0), tmp_path_factory.mktemp("six") / "six")


def edited(source: Path, folder: Path, **config_changes) -> Path:
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(config_changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("layers, fate", [(4, "layers 4-5 would be dropped"), (5, "layer 5 would be dropped"),
                                          (8, "layers 6-7 would run on random weights"),
                                          (7, "layer 6 would run on random weights")])
@pytest.mark.parametrize("tier", ["device", "disk"])
def test_a_layer_count_that_disagrees_is_refused(six_layers, tmp_path, layers, fate, tier):
    folder = edited(six_layers, tmp_path / "m", num_hidden_layers=layers)
    with pytest.raises(ModelLoadError) as err:
        Engine.from_pretrained(folder, [], target_tier=tier, stream_options={"cache_dir": tmp_path / "cache"})
    message = str(err.value)
    assert str(folder / "config.json") in message
    assert f"num_hidden_layers is {layers} but the weights hold 6 layers ({fate})" in message


@pytest.mark.parametrize("change, expected", [
    ({"vocab_size": 100}, "vocab_size is 100 but the embedding (model.embed_tokens.weight) has 96 rows"),
    ({"hidden_size": 32}, "hidden_size is 32 but the embedding (model.embed_tokens.weight) is 64 wide"),
    ({"intermediate_size": 100}, "intermediate_size is 100 but model.layers.0.mlp.up_proj.weight has 128 rows"),
    ({"num_key_value_heads": 4}, "num_key_value_heads x head_dim is 4 x 16 = 64 but "
                                 "model.layers.0.self_attn.k_proj.weight has 32 rows"),
])
def test_other_sizes_blame_config_json_not_the_weights(six_layers, tmp_path, change, expected):
    folder = edited(six_layers, tmp_path / "m", **change)
    with pytest.raises(ModelLoadError) as err:
        load_causal_lm(folder, "target", None, "cpu")
    message = str(err.value)
    assert f"{folder / 'config.json'} does not match the weights" in message and expected in message
    assert "damaged" not in message


def test_the_streaming_loader_refuses_dropped_tensors_itself(six_layers, tmp_path):
    """Called directly (benchmarks do), the streamer compares the files with its model."""
    folder = edited(six_layers, tmp_path / "m", num_hidden_layers=4)
    with pytest.raises(ModelLoadError, match="layers 4-5 would be dropped"):
        load_streamed_causal_lm(folder, tier="ram")


def test_weights_the_layer_counts_miss_are_named(six_layers, tmp_path):
    """A stored tensor no config number accounts for (an attention bias the config turns
    off) would be dropped: the load report's names are given."""
    folder = tmp_path / "m"
    shutil.copytree(six_layers, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.2.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for load in (lambda: load_causal_lm(folder, "target", None, "cpu"),
                 lambda: load_streamed_causal_lm(folder, tier="ram")):
        with pytest.raises(ModelLoadError) as err:
            load()
        message = str(err.value)
        assert str(folder / "config.json") in message
        assert "1 weights in the files have no place" in message and "model.layers.2.self_attn.q_proj.bias" in message


def test_old_rotary_tables_in_a_checkpoint_are_not_a_mismatch(six_layers, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(six_layers, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert load_causal_lm(folder, "target", None, "cpu").config.num_hidden_layers == 6
    load_streamed_causal_lm(folder, tier="ram")


@pytest.mark.parametrize("tier", ["device", "disk"])
def test_a_truncated_weights_file_is_named(six_layers, tmp_path, tier):
    folder = tmp_path / "m"
    shutil.copytree(six_layers, folder)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    first, second = folder / "model-00001-of-00002.safetensors", folder / "model-00002-of-00002.safetensors"
    save_file({"lm_head.weight": tensors.pop("lm_head.weight")}, second, metadata={"format": "pt"})
    save_file(tensors, first, metadata={"format": "pt"})
    with open(first, "r+b") as f:
        f.truncate(first.stat().st_size // 2)
    with pytest.raises(ModelLoadError) as err:
        Engine.from_pretrained(folder, [], target_tier=tier, stream_options={"cache_dir": tmp_path / "cache"})
    assert f"{first} is damaged or incomplete" in str(err.value)
