"""A GGUF target streamed as its own blocks: the same logits as a model holding the
reference-dequantized weights, on every tier, and greedy replies through the engine
identical to its own autoregressive decoding."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from minions_local.core.errors import ModelLoadError  # noqa: E402
from minions_local.models.gguf_target import LAYER_TENSORS, RESIDENT_TENSORS, hf_rows, open_target, side_folder  # noqa: E402,E501
from minions_local.offload.binding import layer_weights  # noqa: E402
from minions_local.offload.gguf_streamed import load_streamed_gguf  # noqa: E402
from tests.helpers.tiny_gguf import write_gguf  # noqa: E402
from tests.helpers.tiny_models import random_model, save, tiny_config  # noqa: E402

PROMPT = [1, 5, 9, 22, 40, 3, 17]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIONS_CACHE_DIR", str(tmp_path / "cache"))


def reference_model(path, arch: str, config):
    """transformers' model holding the `gguf` package's dequantization of every tensor."""
    target = open_target(path)
    model = random_model(config, seed=0)
    state = {}
    for tensor in gguf.GGUFReader(path).tensors:
        shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))
        weights = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy()).reshape(shape)
        if tensor.name.startswith("blk."):
            _, i, rest = tensor.name.split(".", 2)
            name = LAYER_TENSORS[rest]
            order = target.row_order(name)
            state[f"model.layers.{i}.{name}"] = weights if order is None else weights[hf_rows(*order)]
        else:
            state[RESIDENT_TENSORS[tensor.name]] = weights
    assert model.load_state_dict(state, strict=False).missing_keys == []
    return model


CASES = [("llama", "Q4_1", 64), ("qwen2", "Q5_0", 64), ("mistral", "Q8_0", 64), ("llama", "Q4_K", 256),
         ("qwen2", "Q6_K", 256), ("llama", "Q5_K", 256), ("llama", "Q4_0", 64), ("qwen2", "F16", 64)]


@pytest.mark.parametrize("arch,kind,hidden", CASES)
def test_streamed_logits_are_the_gguf_weights(arch, kind, hidden, tmp_path, tokenizer) -> None:
    config = tiny_config(arch, hidden=hidden)
    folder = save(random_model(config, seed=1), tmp_path / arch, tokenizer)
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", kind, embedding_type="Q8_0" if hidden == 64 else "Q6_K")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = reference_model(path, arch, config)(ids).logits
        for tier in ("disk", "ram", "device"):
            model, stats = load_streamed_gguf(path, tier=tier, cache_dir=tmp_path / "packs", buffers=2,
                                              kernel="dequant")
            assert torch.equal(model(ids).logits, want), tier
            if tier != "device":
                layer_bytes = sum(t.nbytes for n, t in open_target(path).file.tensors.items() if n.startswith("blk."))
                assert layer_bytes <= stats.bytes_per_pass < layer_bytes + 64 * 16 * config.num_hidden_layers


def test_unsupported_tensor_type_is_named(tmp_path, tokenizer) -> None:
    folder = save(random_model(tiny_config("llama"), seed=1), tmp_path / "m", tokenizer)
    path = write_gguf(folder, tmp_path / "q51.gguf", "Q4_0", types={"blk.1.ffn_up.weight": "Q5_1"})
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight is stored as Q5_1"):
        load_streamed_gguf(path, tier="ram")
    path = write_gguf(folder, tmp_path / "partial.gguf", "Q4_0", skip=("blk.0.attn_v.weight",))
    with pytest.raises(ModelLoadError, match="lacks the tensor for layer 0's self_attn.v_proj.weight"):
        load_streamed_gguf(path, tier="ram")


@pytest.mark.parametrize("tier,kernel", [("disk", "int4"), ("ram", "int4"), ("disk", "dequant")])
def test_engine_greedy_matches_its_own_autoregressive_decoding(tier, kernel, tmp_path, tokenizer) -> None:
    from minions_local import Engine
    from tests.helpers.tiny_models import noisy_copy

    config = tiny_config("llama", layers=3)
    target = random_model(config, seed=3, scale=25.0)
    path = write_gguf(save(target, tmp_path / "target", tokenizer), tmp_path / "target.gguf", "Q4_1")
    options = {"cache_dir": str(tmp_path / "packs"), "buffers": 2, "kernel": kernel}
    alone = Engine.from_pretrained(path, [], target_tier=tier, stream_options=options)
    # A minion on the GGUF's own vocabulary (the file pads it to the embedding's rows).
    minion = save(noisy_copy(target, seed=4, noise=0.05), tmp_path / "minion")
    for f in side_folder(path).glob("*token*"):
        shutil.copy(f, minion / f.name)
    speculative = Engine.from_pretrained(path, [str(minion), "ngram"], target_tier=tier, budget=16,
                                         stream_options=options)
    for prompt in ([1, 5, 9, 22], [1, 40, 41, 3, 3, 7], "hello world"):
        want = alone.generate(prompt, max_new_tokens=24)
        got = speculative.generate(prompt, max_new_tokens=24)
        assert got.token_ids == want.token_ids
        assert got.tokens_per_pass >= 1.0
    if tier == "disk":  # on a CPU the RAM tier is resident (core/tiers.streams)
        stats = alone.decoder.target.stream_stats
        assert stats.bytes_per_pass > 0 and stats.passes > 0
    # The int4 kernel multiplies the 4-bit weights as they are: none are dequantized.
    packed = [getattr(layer_weights(layer), "int4", False) for layer in alone.decoder.target.model.model.layers]
    assert packed == [kernel == "int4" and tier == "disk"] * config.num_hidden_layers


def test_a_missing_gguf_target_says_so(tmp_path) -> None:
    from minions_local import Engine

    with pytest.raises(ModelLoadError, match="GGUF file .*missing.gguf does not exist"):
        Engine.from_pretrained(tmp_path / "missing.gguf", [])
    (tmp_path / "noise.gguf").write_bytes(np.random.default_rng(0).bytes(5000))
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        Engine.from_pretrained(tmp_path / "noise.gguf", [])
