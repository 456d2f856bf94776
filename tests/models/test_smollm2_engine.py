"""The default profiles on the real model, in float32: a greedy chat reply is exactly
transformers' own greedy generate on the converted folder, resident (cpu-demo) and
streamed from disk with every minion kind drafting (cpu-demo-disk), a feature
drafter reading the streamed target's features among them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.realmodel

QUESTIONS = ["Write a Python function that checks whether a string is a palindrome.",
             "Give three tips for writing clear emails."]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def reference(converted):
    """Per question: the chat prompt's ids and transformers' greedy reply to it (float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted[0]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        reply = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append((question, reply[0, ids.shape[1]:].tolist()))
    return out


def chat(engine) -> list:
    """The engine's greedy reply to each question, each in a new conversation."""
    out = []
    for question in QUESTIONS:
        engine.reset()
        out.append(engine.chat([{"role": "user", "content": question}], max_new_tokens=NEW_TOKENS))
    return out


def test_resident_greedy_chat_equals_transformers_generate(reference):
    from minions_local.engine import Engine

    engine = Engine.from_profile("cpu-demo", dtype="float32", minions=[])
    replies = chat(engine)
    assert [g.token_ids for g in replies] == [tokens for _, tokens in reference]
    assert "def " in replies[0].text  # a real answer, not a repetition


def test_disk_tier_with_every_minion_kind_equals_autoregressive(reference, tmp_path):
    from minions_local.engine import Engine
    from minions_local.engine.from_profile import engine_kwargs_from_profile

    from minions_local.engine.loading import MinionSpec

    kwargs = engine_kwargs_from_profile("cpu-demo-disk", dtype="float32")
    kwargs["stream_options"] = {**kwargs["stream_options"], "cache_dir": str(tmp_path)}
    # Whatever the profile lists, the identity must hold with every kind.
    substitute = next(m for m in kwargs["minions"] if getattr(m, "kind", "") == "substitute")
    self_draft = MinionSpec(path=substitute.path, kind="self_draft", layers=8)
    # A feature drafter of the target's shape (its first layer, taking the token alone):
    # it reads the streamed target's features.
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaForCausalLM
    from tests.helpers.tiny_models import feature_drafter_file

    config = AutoConfig.from_pretrained(kwargs["target"])
    config.num_hidden_layers = 1
    first = LlamaForCausalLM(config)
    state = load_file(str(Path(kwargs["target"]) / "model.safetensors"))
    first.load_state_dict({k: state[k] for k in first.state_dict() if k in state}, strict=False)
    eagle = MinionSpec(path=str(feature_drafter_file(first, tmp_path / "eagle.safetensors", copy_layer=True)),
                       kind="eagle")
    kwargs["minions"] = [substitute, eagle, self_draft, "ngram"]
    engine = Engine.from_pretrained(**kwargs)
    assert engine.minion_names == ["q3_k_m", "eagle", "self-draft-8", "ngram"]
    assert engine.decoder.target.bytes_streamed() > 0  # the load-time check ran streamed passes
    before = engine.decoder.target.bytes_streamed()
    replies = chat(engine)
    assert [g.token_ids for g in replies] == [tokens for _, tokens in reference]
    assert sum(s.accepted for g in replies for s in g.steps) > 0  # the minions' drafts were taken
    assert engine.decoder.target.bytes_streamed() > before
