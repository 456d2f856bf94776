"""The clock's check on the row split (speculation/realized.py): trees go through only
while shared passes with trees realize at least what plain ones do."""

from __future__ import annotations

import pytest

from minions_local.core.events import StepRecord
from minions_local.speculation.budget import PassRecord
from minions_local.speculation.cost import CostModel, GrowTime, VerifyTime
from minions_local.speculation.cost_policy import CostModelBudget
from minions_local.speculation.realized import RealizedRates


def test_trees_that_realize_less_than_plain_passes_are_held_back_and_retried_now_and_then():
    rates = RealizedRates(window=8, least=4, every=4)
    assert [rates.admit_trees(8) for _ in range(4)] == [True, True, True, False]  # one plain pass to measure
    for _ in range(4):
        rates.add(8, False, tokens=8, seconds=0.064)  # 125 tok/s
        rates.add(8, True, tokens=14, seconds=0.140)  # 100 tok/s
    assert rates.rate(8, False) == pytest.approx(125.0) and rates.rate(8, True) == pytest.approx(100.0)
    assert [rates.admit_trees(8) for _ in range(4)] == [False, False, False, True]  # one tree pass to re-measure
    for _ in range(8):
        rates.add(8, True, tokens=20, seconds=0.140)  # trees now realize 143 tok/s
    assert all(rates.admit_trees(8) for _ in range(8))
    assert rates.admit_trees(16) and rates.rate(16, True) is None  # each batch size on its own
    rates.add(1, True, tokens=5, seconds=0.1)
    assert rates.rate(1, True) is None  # a lone request's steps are no shared passes


def _pass(policy, requests, tree, tokens, seconds, t_read=0.0):
    steps = [StepRecord(tree_size=tree, accepted=tokens // requests - 1, t_grow=0.0, t_verify=0.05,
                        new_tokens=tokens // requests, batch_size=requests, pass_rows=requests * (tree + 1),
                        t_step=seconds, t_read=t_read, depth=1 if tree else 0) for _ in range(requests)]
    policy.observe_pass(PassRecord(tuple(steps), 0.05, requests * (tree + 1), t_read, seconds))


def test_the_policy_feeds_its_shared_passes_to_the_check_and_obeys_it():
    model = CostModel(VerifyTime(flat=0.0627, base=0.009, slope=0.00034), (GrowTime("q3", 0.0048, 0.0024),))
    policy = CostModelBudget(model, min_nodes=0, max_nodes=64, max_depth=16)
    policy.rates["greedy"] = (0.9, 0.9)
    policy.price_batch_grows({"q3": 8})
    mix = [(100, "greedy", 0.0)] * 8
    assert all(b.nodes > 0 for b in policy.plan(mix))
    for _ in range(6):
        _pass(policy, 8, tree=0, tokens=8, seconds=0.064)
        _pass(policy, 8, tree=2, tokens=16, seconds=0.200)
        _pass(policy, 8, tree=2, tokens=80, seconds=9.0, t_read=8.0)  # a prompt read: left out
    assert policy.realized.rate(8, True) == pytest.approx(80.0)
    policy.rates["greedy"] = (0.9, 0.9)  # (the refits above fitted it to these records)
    policy._chosen.clear()
    budgets = [policy.plan(mix) for _ in range(policy.realized.every)]
    assert sum(any(b.nodes for b in step) for step in budgets) == 1  # only the re-measuring pass
