"""One pass's rows split between the requests that share it (row_budget.py and
CostModelBudget.choose_shared)."""

from __future__ import annotations

import itertools

from minions_local.speculation.cost import CostModel, GrowTime, VerifyTime
from minions_local.speculation.cost_policy import CostModelBudget
from minions_local.speculation.row_budget import TreeCurve, split_rows


def _curve(rate: float, max_nodes: int, pass_s: float) -> TreeCurve:
    """A chain: node n is accepted with rate**n; one minion pass of `pass_s` per node."""
    gains = [0.0]
    for n in range(1, max_nodes + 1):
        gains.append(gains[-1] + rate ** n)
    return TreeCurve(gains, [0.0] + [pass_s * n for n in range(1, max_nodes + 1)])


def _rate(curves, verify, nodes) -> float:
    tokens = sum(1 + c.gains[n] for c, n in zip(curves, nodes))
    return tokens / (sum(c.grow[n] for c, n in zip(curves, nodes)) + verify(sum(nodes) + len(nodes) - 1))


def test_the_split_is_the_best_split_on_small_cases():
    """Exhaustive search over every split agrees with the greedy one (within 1%)."""
    verify = VerifyTime(flat=0.1, base=0.02, slope=0.004)
    for rates in [(0.9, 0.5), (0.8, 0.8, 0.2), (0.3, 0.95, 0.6)]:
        curves = [_curve(r, 8, 0.004) for r in rates]
        nodes = split_rows(curves, verify)
        best = max(_rate(curves, verify, split) for split in itertools.product(range(9), repeat=len(curves)))
        assert _rate(curves, verify, nodes) >= 0.99 * best


def test_a_request_whose_trees_do_not_pay_decodes_plainly_in_the_pass():
    verify = VerifyTime(flat=0.1, base=0.02, slope=0.004)
    good, hopeless = _curve(0.9, 16, 0.004), _curve(0.01, 16, 0.004)
    nodes = split_rows([good, hopeless], verify)
    assert nodes[0] > 0 and nodes[1] == 0


def test_more_requests_sharing_a_pass_get_smaller_trees():
    """The pass's reads are paid once for all: each tree has less to amortize."""
    verify = VerifyTime(flat=0.1, base=0.02, slope=0.002)
    sizes = [split_rows([_curve(0.8, 32, 0.005)] * k, verify)[0] for k in (1, 4, 16)]
    assert sizes[0] >= sizes[1] >= sizes[2] and sizes[0] > sizes[2]


def test_the_policy_splits_between_regimes_and_never_beyond_a_lone_tree():
    model = CostModel(VerifyTime(flat=0.1, base=0.01, slope=0.001), (GrowTime("m", 0.004, 0.0002),))
    policy = CostModelBudget(model, min_nodes=0, max_nodes=64, max_depth=8)
    policy.rates["sampled"] = 0.3
    alone = {regime: policy.choose(100, regime).nodes for regime in ("greedy", "sampled")}
    budgets = policy.choose_shared([(100, "greedy"), (100, "sampled"), (100, "greedy"), (1, "greedy")])
    assert [b.nodes for b in budgets][3] == 0  # one token left: nothing to draft
    assert budgets[0].nodes == budgets[2].nodes and 0 < budgets[0].nodes <= alone["greedy"]
    assert budgets[1].nodes <= min(alone["sampled"], budgets[0].nodes)
    total = sum(b.nodes for b in budgets) + len(budgets) - 1
    assert all(b.predicted_t_verify == model.t_verify(total) for b in budgets)
    assert policy.choose_shared([(100, "greedy"), (100, "sampled"), (100, "greedy"), (1, "greedy")]) == budgets


def test_a_pending_prompt_read_is_priced_into_a_requests_trees():
    """A batch request whose minions have not read its prompt pays the read with its
    first tree: dear enough, and the split decodes it without one; a probe then grows
    one tree, for the request cheapest to read, not one for every request."""
    model = CostModel(VerifyTime(flat=0.1, base=0.01, slope=0.001), (GrowTime("m", 0.004, 0.0002),))
    policy = CostModelBudget(model, min_nodes=0, max_nodes=64, max_depth=8, probe_every=4)
    assert all(b.nodes > 0 for b in policy.choose_shared([(100, "greedy", 0.0)] * 4))
    assert all(b.nodes > 0 for b in policy.choose_shared([(100, "greedy", 0.05)] * 4))  # 0.5 ms a token
    dear = [(100, "greedy", 30.0), (100, "greedy", 20.0), (100, "greedy", 25.0)]
    picks = [policy.choose_shared(dear) for _ in range(4)]
    assert all(b.nodes == 0 for step in picks[:3] for b in step)
    assert [b.nodes > 0 for b in picks[3]] == [False, True, False]  # the probe: the cheapest read
    assert picks[0][0].predicted_t_grow == 0.0
    policy.rates["greedy"] = 0.02  # no tree pays, read or not
    policy._chosen.clear()
    read = [(100, "greedy", 0.0), (100, "greedy", 20.0), (100, "greedy", 0.0)]  # two have read
    picks = [policy.choose_shared(read) for _ in range(4)]
    assert all(b.nodes == 0 for step in picks[:3] for b in step)
    assert [b.nodes > 0 for b in picks[3]] == [True, False, True]  # probes cost them growing only
