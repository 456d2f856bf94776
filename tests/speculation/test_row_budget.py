"""One pass's rows split between the requests that share it (row_budget.py and
CostModelBudget.plan)."""

from __future__ import annotations

import itertools
import random

from minions_local.speculation.budget import TreeAsk
from minions_local.speculation.cost import CostModel, GrowTime, VerifyTime
from minions_local.speculation.cost_policy import CostModelBudget
from minions_local.speculation.row_budget import BatchGrowCost, TreeCurve, split_rows


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
    budgets = policy.plan([(100, "greedy"), (100, "sampled"), (100, "greedy"), (1, "greedy")])
    assert [b.nodes for b in budgets][3] == 0  # one token left: nothing to draft
    assert budgets[0].nodes == budgets[2].nodes and 0 < budgets[0].nodes <= alone["greedy"]
    assert budgets[1].nodes <= min(alone["sampled"], budgets[0].nodes)
    total = sum(b.nodes for b in budgets) + len(budgets) - 1
    assert all(b.predicted_t_verify == model.t_verify(total) for b in budgets)
    assert policy.plan([(100, "greedy"), (100, "sampled"), (100, "greedy"), (1, "greedy")]) == budgets


def test_a_lone_request_plans_its_own_best_tree_whatever_its_pending_read():
    """One request in a pass gets what `choose` gives it, a pending read or not (it
    has no pass to share: its best tree is searched whole), probes included."""
    rng = random.Random(7)
    for _ in range(40):
        model = CostModel(VerifyTime(flat=rng.uniform(0.02, 0.3), base=rng.uniform(0.001, 0.05),
                                     slope=rng.uniform(1e-4, 5e-3)),
                          (GrowTime("m", rng.uniform(0.001, 0.03), rng.uniform(1e-4, 3e-3)),))
        planned, chosen = (CostModelBudget(model, min_nodes=0, max_nodes=64, max_depth=12, probe_every=4)
                           for _ in range(2))
        for _ in range(12):
            remaining, regime = rng.choice([1, 2, 5, 100]), rng.choice(["greedy", "sampled", "seeded"])
            ask = TreeAsk(remaining, regime, rng.choice([0.0, 0.3]))
            assert planned.plan([ask]) == [chosen.choose(remaining, regime)]


def test_a_pending_prompt_read_is_priced_into_a_requests_trees():
    """A batch request whose minions have not read its prompt pays the read with its
    first tree: dear enough, and the split decodes it without one; a probe then grows
    one tree, for the request cheapest to read, not one for every request."""
    model = CostModel(VerifyTime(flat=0.1, base=0.01, slope=0.001), (GrowTime("m", 0.004, 0.0002),))
    policy = CostModelBudget(model, min_nodes=0, max_nodes=64, max_depth=8, probe_every=4)
    assert all(b.nodes > 0 for b in policy.plan([(100, "greedy", 0.0)] * 4))
    assert all(b.nodes > 0 for b in policy.plan([(100, "greedy", 0.05)] * 4))  # 0.5 ms a token
    dear = [(100, "greedy", 30.0), (100, "greedy", 20.0), (100, "greedy", 25.0)]
    picks = [policy.plan(dear) for _ in range(4)]
    assert all(b.nodes == 0 for step in picks[:3] for b in step)
    assert [b.nodes > 0 for b in picks[3]] == [False, True, False]  # the probe: the cheapest read
    assert picks[0][0].predicted_t_grow == 0.0
    policy.rates["greedy"] = 0.02  # no tree pays, read or not
    policy._chosen.clear()
    read = [(100, "greedy", 0.0), (100, "greedy", 20.0), (100, "greedy", 0.0)]  # two have read
    picks = [policy.plan(read) for _ in range(4)]
    assert all(b.nodes == 0 for step in picks[:3] for b in step)
    assert [b.nodes > 0 for b in picks[3]] == [True, False, True]  # probes cost them growing only


def _levels_curve(rate: float, max_nodes: int) -> TreeCurve:
    """A chain priced only by a shared-pass minion: no growing of its own."""
    gains = [0.0]
    for n in range(1, max_nodes + 1):
        gains.append(gains[-1] + rate ** n)
    return TreeCurve(gains, [0.0] * (max_nodes + 1), list(range(max_nodes + 1)))


def test_a_shared_pass_minion_pays_its_fixed_cost_once_a_level_for_all_requests():
    """8 requests whose trees one pass grows: from no trees, no single request's first
    tree pays the pass's fixed cost, but all eight together do; priced as 8 lone
    grows, none would."""
    verify = VerifyTime(flat=0.0627, base=0.009, slope=0.00034)
    shared = BatchGrowCost(base=0.0048, per_node=0.0024, group=8)
    curves = [_levels_curve(0.9, 8)] * 8
    nodes = split_rows(curves, verify, shared)
    assert all(n > 0 for n in nodes)
    assert shared(3, 8, 24) == 0.0048 * 3 + 0.0024 * 24
    assert shared(3, 16, 48) == 0.0048 * 3 * 2 + 0.0024 * 48  # two groups: two passes a level
    alone = TreeCurve(curves[0].gains, [0.0] + [0.0048 * n + 0.0024 * n for n in range(1, 9)])
    assert split_rows([alone] * 8, verify) == [0] * 8


def test_the_split_with_shared_growing_is_near_the_best_split_on_small_cases():
    verify = VerifyTime(flat=0.06, base=0.01, slope=0.0005)
    shared = BatchGrowCost(base=0.006, per_node=0.002, group=2)

    def rate(curves, nodes):
        depth = max(c.levels[n] for c, n in zip(curves, nodes))
        grow = shared(depth, sum(n > 0 for n in nodes), sum(nodes)) + sum(c.grow[n] for c, n in zip(curves, nodes))
        return sum(1 + c.gains[n] for c, n in zip(curves, nodes)) / (grow + verify(sum(nodes) + len(nodes) - 1))

    for rates in [(0.9, 0.5), (0.8, 0.8, 0.2), (0.3, 0.95, 0.6)]:
        curves = [_levels_curve(r, 6) for r in rates]
        nodes = split_rows(curves, verify, shared)
        best = max(rate(curves, split) for split in itertools.product(range(7), repeat=len(curves)))
        assert rate(curves, nodes) >= 0.97 * best


def test_the_policy_prices_a_shared_pass_minion_once_for_the_batch():
    """price_batch_grows names the minion whose passes a batch shares: then 8 requests get
    trees that, priced request by request, would not pay."""
    model = CostModel(VerifyTime(flat=0.0627, base=0.009, slope=0.00034),
                      (GrowTime("q3", 0.0048, 0.0024), GrowTime("ngram", 3e-5, 0.0)), step_overhead=0.0001)
    policy = CostModelBudget(model, min_nodes=0, max_nodes=64, max_depth=16)
    policy.rates["greedy"] = (0.9, 0.9)
    policy.decays["greedy"] = 0.95
    mix = [(100, "greedy", 0.0)] * 8
    assert all(b.nodes == 0 for b in policy.plan(mix))
    policy.price_batch_grows({"q3": 8, "ngram": 1})
    assert policy.grow_groups == {"q3": 8}
    budgets = policy.plan(mix)
    assert all(b.nodes > 0 for b in budgets)
    # each request's predicted grow is its own part plus an equal share of the shared passes
    depth = max(b.depth for b in budgets)
    share = (0.0048 * depth + 0.0024 * sum(b.nodes for b in budgets)) / 8
    assert abs(budgets[0].predicted_t_grow - share) < 0.001
