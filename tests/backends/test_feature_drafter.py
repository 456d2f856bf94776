"""The feature drafter ('eagle'): the target keeps its features through prefill,
verify and commit; the drafter reads them at the right positions; decoding with it
stays token-identical; and bad weight files are refused with a way out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from minions_local import Engine
from minions_local.core.events import TokenEvent
from minions_local.core.errors import ModelLoadError
from minions_local.engine.loading import MinionSpec, load_minion
from minions_local.models import drafter
from tests.helpers.tiny_models import feature_drafter_file, hf_greedy, random_model, save, tiny_config


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = random_model(tiny_config("llama", layers=1), seed=5, scale=25.0)
    return save(target, root / "target"), target, feature_drafter_file(target, root / "eagle.safetensors", copy_layer=True)


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = random_model(tiny_config("llama", layers=3), seed=6, scale=25.0)
    return save(target, root / "target"), target, feature_drafter_file(target, root / "eagle.safetensors", copy_layer=False)


def reference_features(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]


def decoded_so_far(engine: Engine, prompt: list[int], tokens: int):
    """(the stream, prompt + the first `tokens` or more reply tokens), the stream paused
    mid-reply: once a reply ends, the target keeps only its prompt's entries."""
    stream = engine.stream(prompt, max_new_tokens=2 * tokens)
    reply: list[int] = []
    for event in stream:
        if isinstance(event, TokenEvent):
            reply += event.token_ids
            if len(reply) >= tokens:
                break
    return stream, prompt + reply


def test_the_target_keeps_each_committed_positions_feature(three_layers):
    """After prefill and several verified trees (branches rejected, paths kept), the
    features the target holds are those a fresh forward over the same tokens gives."""
    folder, model, weights = three_layers
    engine = Engine.from_pretrained(folder, [f"eagle:{weights}"], dtype="float32", budget=12, max_depth=4)
    prompt = [5, 9, 17, 4, 33, 8]
    stream, context = decoded_so_far(engine, prompt, 20)
    target = engine.decoder.target
    held = target.features_of(context)
    assert held.shape[0] >= len(context) - 2  # everything but the last token or two
    assert torch.allclose(held, reference_features(model, context[:held.shape[0]]), atol=1e-4)
    assert target.features_of([99, 98]).shape[0] == 0  # another conversation: nothing of it
    stream.close()
    assert target.features_of(context).shape[0] == len(prompt) - 1  # the reply's entries are gone


def test_the_drafter_reads_the_feature_before_each_token(three_layers):
    folder, model, weights = three_layers
    engine = Engine.from_pretrained(folder, [f"eagle:{weights}"], dtype="float32", budget=12, max_depth=4)
    prompt = [7, 3, 44, 12, 9]
    stream, context = decoded_so_far(engine, prompt, 16)
    minion = engine.decoder.minions[0]
    logits, base = minion._run_root(context)
    stream.close()
    assert base == len(context) - 2
    # The drafter by hand: input i = fc([embed(context[i + 1]), feature(context[i])]).
    draft, fc = drafter.build_drafter(model, weights)
    f = reference_features(model, context[:-1])
    with torch.no_grad():
        x = F.linear(torch.cat([model.model.embed_tokens.weight[context[1:]], f], dim=-1), fc)
        expected = draft(inputs_embeds=x.unsqueeze(0)).logits[0, -1]
    assert torch.allclose(logits, expected, atol=1e-3)


def test_decoding_with_the_drafter_is_token_identical_and_it_is_accepted(one_layer, tmp_path):
    folder, model, weights = one_layer
    untrained = feature_drafter_file(model, tmp_path / "random.safetensors", copy_layer=False)
    mean_accepted = {}
    for name, path in (("copy", weights), ("random", untrained)):
        engine = Engine.from_pretrained(folder, [f"eagle:{path}"], dtype="float32", budget=8, max_depth=8)
        accepted = []
        for prompt in ([5, 9, 17, 4], [40, 41, 3], [11] * 6):
            out = engine.generate(prompt, max_new_tokens=40)
            assert out.token_ids == hf_greedy(model, prompt, 40)
            accepted += [s.accepted for s in out.steps]
        mean_accepted[name] = sum(accepted) / len(accepted)
    # A copy of a one-layer target guesses it well (it misses only the first token:
    # measured 2.9 tokens a step); random weights guess nothing.
    assert mean_accepted["copy"] > 2 and mean_accepted["random"] < 1, mean_accepted


def test_sampling_with_the_drafter_stays_in_the_targets_vocabulary(three_layers):
    folder, _, weights = three_layers
    engine = Engine.from_pretrained(folder, [f"eagle:{weights}", "ngram"], dtype="float32", budget=16)
    out = engine.generate([5, 9, 17], max_new_tokens=30, temperature=0.8, seed=3)
    assert len(out.token_ids) == 30 and all(0 <= t < 96 for t in out.token_ids)


def test_bad_drafter_files_are_refused_with_a_way_out(three_layers, tmp_path):
    folder, model, _ = three_layers
    engine = Engine.from_pretrained(folder, [], dtype="float32")
    target = engine.decoder.target

    def load(path):
        return load_minion(MinionSpec(path=str(path), kind="eagle"), index=0, target_path=folder,
                           target_tokenizer=None, target_vocab=96, dtype=torch.float32, device="cpu",
                           progress=None, target=target)

    with pytest.raises(ModelLoadError, match="weights are missing.*train_drafter.py all"):
        load(tmp_path / "absent.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="damaged"):
        load(tmp_path / "junk.safetensors")
    wide = random_model(tiny_config("llama", hidden=32, heads=4, layers=1), seed=1)
    with pytest.raises(ModelLoadError, match="hidden size 32, not this target's 64.*train_drafter"):
        load(feature_drafter_file(wide, tmp_path / "wide.safetensors", copy_layer=False))
    with pytest.raises(ModelLoadError, match="needs the path of a weights file trained for it"):
        load("")
    with pytest.raises(ModelLoadError, match="engine's own target"):
        load_minion(MinionSpec(path="eagle"), index=0, target_path=folder, target_tokenizer=None, target_vocab=96,
                    dtype=torch.float32, device="cpu", progress=None, target=None)
