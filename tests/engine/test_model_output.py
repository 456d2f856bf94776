"""A model that computes NaN or infinite logits stops the reply with a clear error,
instead of a reply that 'finishes' normally (argmax takes NaN as the best score)."""

from __future__ import annotations

import math

import pytest
import torch

from minions_local.core.errors import ModelOutputError
from minions_local.core.events import DoneEvent
from minions_local.engine import Engine
from tests.helpers.tiny_models import random_model, save, tiny_config


@pytest.fixture(scope="module")
def nan_target(tmp_path_factory, tokenizer):
    model = random_model(tiny_config("llama"), 0, scale=25.0)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = math.nan  # one damaged weight poisons every position
    return save(model, tmp_path_factory.mktemp("nan") / "nan-target", tokenizer)


@pytest.mark.parametrize("minions", [[], ["ngram"]])
def test_nan_logits_stop_the_reply_with_a_clear_error(nan_target, minions):
    engine = Engine.from_pretrained(nan_target, minions)
    with pytest.raises(ModelOutputError, match="computed NaN logits"):
        engine.generate([5, 6, 7, 5, 6, 7], max_new_tokens=8)
    events = engine.stream_chat([{"role": "user", "content": "hi"}], max_new_tokens=8)
    with pytest.raises(ModelOutputError, match="weights may be damaged"):
        list(events)
    with pytest.raises(ModelOutputError):  # the engine is free again and says the same
        engine.generate([5], max_new_tokens=2, temperature=0.7, seed=1)


def test_infinite_logits_too(families):
    engine = Engine.from_pretrained(families["llama"]["target"], [families["llama"]["close"]])
    reference = engine.generate([5, 6, 7], max_new_tokens=6).token_ids
    target = engine.decoder.target
    verify = target.verify

    def overflowing(context, tree):
        logits = verify(context, tree).clone()
        logits[-1, 3] = math.inf
        return logits

    target.verify = overflowing
    engine.reset()
    with pytest.raises(ModelOutputError, match="computed infinite logits"):
        engine.generate([5, 6, 7], max_new_tokens=6)
    target.verify = verify
    events = list(engine.stream([5, 6, 7], max_new_tokens=6))
    assert isinstance(events[-1], DoneEvent) and events[-1].generation.token_ids == reference
