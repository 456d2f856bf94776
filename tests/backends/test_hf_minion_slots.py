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
from tests.helpers.slots import Request, alone, batched, interleaved
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


def _passes(minion) -> list[int]:
    """Records the parts (requests) of each compact pass the minion runs."""
    parts: list[int] = []
    forward_parts = minion.runner.decoder.forward_parts
    minion.runner.decoder.forward_parts = lambda ps: parts.append(len(ps)) or forward_parts(ps)
    return parts


@pytest.mark.parametrize("sampled", [False, True])
def test_a_batched_grow_grows_what_each_request_grows_alone(model, sampled):
    """grow_batch: the requests' roots in one compact pass, then one pass per tree
    level for all of them; each tree is the one a minion of its own grows (drawn ones
    too: each request draws from its own generator in the same order), the shorter
    request leaving early. A shared pass has more rows, so log-probabilities agree to
    float32 rounding."""
    from minions_local.core.sampling import SamplingParams

    def budget(slot: int) -> GrowBudget:
        if not sampled:
            return BUDGET
        draws = torch.Generator().manual_seed(slot)
        return GrowBudget(max_nodes=10, max_depth=4, width=3, top_k=3,
                          sampling=SamplingParams(temperature=0.8), generator=draws)

    requests = {slot: Request(prompt, steps=3 - (slot == 2), budget=budget(slot)) for slot, prompt in enumerate(PROMPTS)}
    expected = {slot: alone(lambda: HFMinion(model, "m"), Request(r.prompt, r.steps, budget(slot)))
                for slot, r in requests.items()}
    minion = HFMinion(model, "m")
    passes = _passes(minion)
    got = batched(minion, requests)
    for slot in requests:
        assert [(t, p) for t, p, _ in got[slot]] == [(t, p) for t, p, _ in expected[slot]]
        for (_, _, lp), (_, _, want) in zip(got[slot], expected[slot]):
            assert lp == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert max(passes) == 3  # the three requests' levels ran together
    assert len(passes) <= 3 * (1 + BUDGET.max_depth)  # a root pass and a pass per level, each step


def test_a_batch_reads_its_prompts_in_one_pass_as_each_alone(model):
    """prefill_batch: every prompt (but its root) in one compact pass; each request
    then grows the tree it grows after a prefill of its own."""
    alone_minion = HFMinion(model, "m")
    want = {}
    for slot, prompt in enumerate(PROMPTS, start=1):
        alone_minion.use_slot(slot)
        alone_minion.prefill(prompt)
        want[slot] = alone_minion.grow(prompt, BUDGET)
    together = HFMinion(model, "m")
    passes = _passes(together)
    together.prefill_batch(list(enumerate(PROMPTS, start=1)))
    assert passes == [3]
    for slot, prompt in enumerate(PROMPTS, start=1):
        together.use_slot(slot)
        assert together.runner.cached == prompt[:-1]
        got = together.grow(prompt, BUDGET)
        assert (got.tokens, got.parents) == (want[slot].tokens, want[slot].parents)
        assert got.logprobs == pytest.approx(want[slot].logprobs, rel=1e-4, abs=1e-4)


def test_a_batch_without_the_compact_forward_grows_one_request_at_a_time(model):
    """transformers' own forward cannot share a pass between caches: grow_batch and
    prefill_batch fall back to each request in turn, with the same trees."""
    requests = {slot: Request(prompt, steps=2, budget=BUDGET) for slot, prompt in enumerate(PROMPTS)}
    expected = {slot: alone(lambda: HFMinion(model, "m", compact=False), r) for slot, r in requests.items()}
    minion = HFMinion(model, "m", compact=False)
    assert batched(minion, requests) == expected
    reader = HFMinion(model, "m", compact=False)
    reader.prefill_batch([(slot, r.prompt) for slot, r in requests.items()])
    for slot, r in requests.items():
        reader.use_slot(slot)
        assert reader.runner.cached == r.prompt[:-1]
