"""Requests on slots of one transformers minion and one feature drafter: each slot
keeps its own cache in the runner (and, for the drafter, its count of entries made
from the target's real features), so interleaved requests grow exactly what they
would grow alone, and coming back to a slot finds its cache."""

from __future__ import annotations

import pytest
import torch

from minions_local.backends.eagle import FeatureMinion, FeatureRunner
from minions_local.backends.hf_minion import HFMinion
from minions_local.core.protocols import GrowBudget
from minions_local.models import drafter
from tests.helpers.slots import Request, alone, interleaved
from tests.helpers.tiny_models import feature_drafter_file, random_model, tiny_config

BUDGET = GrowBudget(max_nodes=10, max_depth=4, width=3, top_k=3)
PROMPTS = [[5, 9, 17, 4, 33, 8, 21], [40, 41, 3, 12, 7], [11, 60, 11, 60, 2, 9, 70, 71, 72]]


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config("llama", layers=2), seed=4, scale=6.0)


def _requests() -> dict[int, Request]:
    return {slot: Request(prompt, steps=4, budget=BUDGET) for slot, prompt in enumerate(PROMPTS)}


@pytest.mark.parametrize("compact", [True, False])
def test_interleaved_requests_grow_what_they_grow_alone(model, compact):
    requests = _requests()
    expected = {slot: alone(lambda: HFMinion(model, "m", compact=compact), r) for slot, r in requests.items()}
    minion = HFMinion(model, "m", compact=compact)
    assert interleaved(minion, requests) == expected
    minion.use_slot(0)
    assert minion.runner.cached[:len(PROMPTS[0])] == PROMPTS[0]  # the conversation's cache is still there
    minion.drop_slot(2)
    assert minion.runner.slots_held() == [0, 1]
    minion.use_slot(2)
    assert minion.runner.cached == [] and minion.runner.cache_len == 0


class LaggingFeatures:
    """A target's features as the engine's target holds them: known for every token it
    has verified, which is all but the last two of what the minion grows from (the
    accepted tokens not verified yet). The drafter runs those from zeros, then redoes
    them once their real features arrive."""

    def __init__(self, model) -> None:
        self.model = model

    def features_of(self, tokens: list[int]) -> torch.Tensor:
        known = tokens[:max(0, len(tokens) - 2)]
        if not known:
            return torch.zeros(0, self.model.config.hidden_size)
        with torch.no_grad():
            return self.model(torch.tensor([known]), output_hidden_states=True).hidden_states[-1][0]


def test_interleaved_requests_on_the_feature_drafter_grow_what_they_grow_alone(model, tmp_path):
    """Each slot redoes its own entries made from zeros: a count shared between
    requests would keep another request's guesses or redo the wrong positions."""
    weights = feature_drafter_file(model, tmp_path / "eagle.safetensors", copy_layer=True)

    def make() -> FeatureMinion:
        return FeatureMinion(FeatureRunner(*drafter.build_drafter(model, weights)), LaggingFeatures(model), "eagle")

    requests = _requests()
    expected = {slot: alone(make, r) for slot, r in requests.items()}
    minion = make()
    assert interleaved(minion, requests) == expected
    runner = minion.runner
    reals = {}
    for slot in (1, 2, 0):
        minion.use_slot(slot)
        reals[slot] = runner.real
        assert 0 < runner.real < len(runner.cached)  # the last entries still wait for their features
    assert len(set(reals.values())) > 1
    minion.drop_slot(1)
    minion.use_slot(1)
    assert runner.real == 0 and runner.cached == []
