"""A minion or budget policy of a user's own, inheriting nothing of ours, serves a batch:
the loader wraps it to answer what it lacks with the base classes' defaults."""

from __future__ import annotations

from pathlib import Path

from minions_local.core.minion import BaseMinion
from minions_local.core.protocols import CandidateTree
from minions_local.core.sampling import SamplingParams
from minions_local.engine.loading import as_policy, load_minion
from minions_local.speculation.budget import BudgetPolicy, StepBudget
from minions_local.speculation.calibration import calibrate_policy
from minions_local.speculation.decode import Decoder
from minions_local.speculation.lanes import StepRequest
from tests.speculation.test_speculation_units import ChainTarget


class OwnMinion:
    """Proposes the chain 10, 11, ...: the Minion protocol's members and nothing else."""

    vocab_size = 50

    def __init__(self, name):
        self.name, self.grown = name, []

    def prefill(self, context):
        pass

    def grow(self, context, budget):
        self.grown.append(list(context))
        tree, parent = CandidateTree(), -1
        for i in range(budget.max_depth):
            parent = tree.add(10 + i, parent, -0.01 * (i + 1))
        return tree

    def commit(self, accepted):
        pass

    def reset(self):
        pass


class OwnBatchMinion(OwnMinion):
    """One with a grow_batch of its own, and no word of how many requests a pass holds."""

    def __init__(self, name):
        super().__init__(name)
        self.calls = []

    def grow_batch(self, requests):
        self.calls.append([slot for slot, _, _ in requests])
        return [self.grow(context, budget) for _, context, budget in requests]


class OwnPolicy:
    """choose and observe only."""

    def choose(self, remaining_tokens, regime="greedy"):
        return StepBudget(nodes=4, depth=2, width=2)

    def observe(self, record):
        pass


def _load(minion):
    return load_minion(minion, index=0, target_path=Path("."), target_tokenizer=None, target_vocab=50,
                       dtype=None, device="cpu", progress=None)


def test_a_users_minion_and_policy_serve_a_batch_with_the_defaults():
    plain, batching = _load(OwnMinion("own")), _load(OwnBatchMinion("batching"))
    assert isinstance(plain, BaseMinion) and not plain.grows_batches and batching.grows_batches
    assert plain.depth_is_free is False and plain.grows_ahead is False and plain.name == "own"
    policy = as_policy(OwnPolicy())
    assert isinstance(policy, BudgetPolicy) and not policy.uses_timed_passes
    assert calibrate_policy(policy, [plain], vocab=50) == {}  # nothing to time for it
    decoder = Decoder(ChainTarget(), [plain, batching], policy, selection="all")
    decoder.expect_requests(2)
    requests = [StepRequest([1, 2, 3 + i], SamplingParams(0.0), None, 100, slot=i + 1) for i in range(2)]
    results = decoder.step_shared(requests)
    assert [r.tokens for r in results] == [[10, 11, 12]] * 2
    assert batching.minion.calls == [[1, 2]] and len(plain.minion.grown) == 2
    # its grow_batch was always taken to hold every request in one pass a level
    assert {r.record.minion_shared["batching"][2] for r in results} == {2}
    decoder.release(1)
    plain.name = "renamed"  # loading.unique_names renames the user's object itself
    assert plain.minion.name == "renamed"
