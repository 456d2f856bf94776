"""A split GGUF (MODEL-00001-of-00002.gguf, the usual form of a 70B download) is one
model: our header reading sees every shard (sizes, dims, tensors), llama.cpp loads the
rest from the first, and a target on it, streamed or not, is the unsplit file's."""

from __future__ import annotations

import numpy as np
import pytest

from minions_local.core.errors import ModelLoadError, ProfileError
from minions_local.core.tree import TokenTree

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    """A tiny Llama (3 layers) as one GGUF and as 2 shards of 8 tensors and the rest."""
    from tests.helpers.tiny_gguf import write_gguf
    from tests.helpers.tiny_models import random_model, save, tiny_config

    root = tmp_path_factory.mktemp("split")
    config = tiny_config("llama", hidden=256, layers=3, ctx=1024)
    folder = save(random_model(config, seed=5, scale=4.0), root / "hf", tokenizer)
    whole = write_gguf(folder, root / "whole.gguf", "Q4_K", embedding_type="Q6_K")
    (root / "split").mkdir()
    first = write_gguf(folder, root / "split" / "model.gguf", "Q4_K", embedding_type="Q6_K", shard_tensors=16)
    return whole, first


def test_every_shard_is_read_as_one_model(model):
    from minions_local.models.gguf_file import read_gguf, read_model, shard_paths
    from minions_local.profile.dims import dims_for
    from minions_local.profile.gguf_sizes import file_layer_bytes, gguf_outside_layers_bytes

    whole, first = model
    paths = shard_paths(first)
    assert [p.name for p in paths] == ["model-00001-of-00002.gguf", "model-00002-of-00002.gguf"]
    assert shard_paths(paths[1]) == paths  # any shard names them all
    one, split = read_gguf(whole), read_model(paths[1])
    assert split.paths == paths and split.path == first
    assert split.size == sum(p.stat().st_size for p in paths)
    assert set(split.tensors) == set(one.tensors) and len(split.files[0].tensors) == 16
    # the second shard holds only the split keys, as gguf-split writes it
    assert set(split.files[1].metadata) == {"split.no", "split.count", "split.tensors.count"}
    assert dims_for(str(first), None, "target") == dims_for(str(whole), None, "target")
    assert file_layer_bytes(first, 3) == file_layer_bytes(whole, 3)
    assert gguf_outside_layers_bytes(str(first), None, dims_for(str(whole), None, "t")) == \
        gguf_outside_layers_bytes(str(whole), None, dims_for(str(whole), None, "t"))


def test_a_missing_or_foreign_shard_is_named(model, tmp_path):
    import shutil

    from minions_local.models.gguf_file import read_model, shard_paths
    from minions_local.profile.dims import dims_for

    paths = shard_paths(model[1])
    shutil.copy(paths[0], tmp_path / paths[0].name)
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002.gguf is missing: the model is split into 2 "):
        read_model(tmp_path / paths[0].name)
    with pytest.raises(ProfileError, match="is missing"):  # --plan says the same
        dims_for(str(tmp_path / paths[0].name), None, "target")
    shutil.copy(model[0], tmp_path / paths[1].name)  # an unsplit file where shard 2 belongs
    with pytest.raises(ModelLoadError, match="does not say it is part 2 of 2"):
        read_model(tmp_path / paths[0].name)


@pytest.mark.gguf
def test_llama_cpp_loads_the_split_model_from_its_first_shard(model):
    """The same logits as the unsplit file, resident and with a layer streamed through the
    page cache (the streamer given both shards' ranges: a layer of this split lies in both)."""
    pytest.importorskip("llama_cpp")
    from minions_local.backends.llama_load import load_llama_target

    whole, first = model
    prompt = [1, 5, 9, 14, 20, 31]
    rows = []
    for path, tiers in ((whole, None), (first, None), (first.with_name("model-00002-of-00002.gguf"),
                                                        ["device", "disk", "disk"])):
        target, vocab = load_llama_target(path, context_tokens=256, threads=2, layer_tiers=tiers)
        try:
            assert len(vocab) == target.vocab_size
            if tiers:
                assert target.streamer is not None and {s.file for s in sum(target.streamer.spans, [])} == {0, 1}
            target.use_slot(0)
            target.reset()
            target.prefill(prompt)
            rows.append(target.verify(prompt, TokenTree.from_root(prompt[-1]))[0].numpy().copy())
        finally:
            target.close()
    assert np.array_equal(rows[0], rows[1]) and np.array_equal(rows[0], rows[2])


@pytest.mark.gguf
def test_a_split_minion_is_named_by_any_shard(model):
    pytest.importorskip("llama_cpp")
    from minions_local.engine import Engine

    whole, first = model
    engine = Engine.from_pretrained(whole, [str(first.with_name("model-00002-of-00002.gguf"))], budget=4)
    assert engine.minion_names == ["model-00001-of-00002"]  # llama.cpp loads it from its first shard
    assert len(engine.generate([1, 5, 9], max_new_tokens=4).token_ids) == 4


def test_streamed_layers_are_spread_between_the_resident_ones():
    from minions_local.backends.llama_load import spread_resident

    assert spread_resident(32, 32) == set(range(32)) and spread_resident(4, 0) == set()
    resident = spread_resident(32, 19)
    streamed = sorted(set(range(32)) - resident)
    assert len(resident) == 19 and len(streamed) == 13
    assert max(b - a for a, b in zip(streamed, streamed[1:])) <= 3  # no run of resident layers longer than 2
    assert streamed[0] <= 2 and streamed[-1] >= 29
