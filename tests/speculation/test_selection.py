"""Learned minion weighting: converges to the better minion, skips a useless costly one."""

import math
import random

from minions_local.core.protocols import CandidateTree
from minions_local.speculation.selection import MinionSelector
from minions_local.speculation.vote import merge_greedy


def chain(tokens, p=0.8):
    tree = CandidateTree()
    for i, t in enumerate(tokens):
        tree.add(t, i - 1, math.log(p) * (i + 1))
    return tree


def accepted_path(tree, truth):
    path, node = [0], 0
    for t in truth:
        node = tree.child(node, t)
        if node is None:
            break
        path.append(node)
    return path


def simulate(selector, steps, quality, cost, rng):
    """quality[m]: probability that minion m's chain is the true continuation."""
    runs = [0] * len(quality)
    for _ in range(steps):
        truth = [rng.randrange(100, 200) for _ in range(6)]
        ran = selector.choose()
        proposals = [
            (chain(truth) if rng.random() < q else chain([rng.randrange(200, 300) for _ in range(6)])) if r else None
            for q, r in zip(quality, ran)]
        tree = merge_greedy(1, proposals, selector.weights())
        path = accepted_path(tree, truth)
        grow = [c if r else 0.0 for c, r in zip(cost, ran)]
        selector.observe(tree, path, proposals, grow, sum(grow) + 0.05, len(path))
        runs = [n + r for n, r in zip(runs, ran)]
    return runs


def test_weights_converge_to_the_better_minion():
    selector = MinionSelector(["good", "poor"], skips_minions=False)
    simulate(selector, 80, quality=[0.9, 0.1], cost=[0.01, 0.01], rng=random.Random(0))
    good, poor = selector.weights()
    assert good == 1.0 and poor < 0.3


def test_costly_useless_minion_is_skipped_but_retried():
    selector = MinionSelector(["good", "useless"])
    runs = simulate(selector, 200, quality=[0.9, 0.0], cost=[0.01, 0.2], rng=random.Random(1))
    assert runs[0] == 200
    assert 3 <= runs[1] <= 40, runs  # mostly skipped, yet re-checked now and then


def test_cheap_helpful_minion_keeps_running():
    selector = MinionSelector(["a", "b"])
    runs = simulate(selector, 100, quality=[0.5, 0.5], cost=[0.001, 0.001], rng=random.Random(2))
    assert runs == [100, 100]


def test_selection_modes():
    equal = MinionSelector.for_mode(["a", "b"], "equal")
    simulate(equal, 30, quality=[0.9, 0.0], cost=[0.01, 0.5], rng=random.Random(3))
    assert equal.weights() == [1.0, 1.0] and equal.choose() == [True, True]
    everyone = MinionSelector.for_mode(["a", "b"], "all")
    runs = simulate(everyone, 30, quality=[0.9, 0.0], cost=[0.01, 0.5], rng=random.Random(3))
    assert runs == [30, 30] and everyone.weights()[1] < 0.5


def test_costly_minion_defers_to_a_confident_cheap_one():
    from minions_local.speculation.selection import minion_estimate

    selector = MinionSelector(["llm", "ngram"])
    selector.stats[0].cost, selector.stats[1].cost = 0.02, 0.0002
    selector.stats[0].record = 2.0
    assert selector.order() == [1, 0]
    confident = chain([5, 6, 7, 8, 9, 10], p=0.95)
    assert minion_estimate(confident) > 2.0
    assert not selector.still_needed(0, minion_estimate(confident))
    assert selector.still_needed(0, minion_estimate(chain([5], p=0.3)))
    tree = merge_greedy(1, [None, confident], [1.0, 1.0])
    selector.observe(tree, [0], [None, confident], [0.0, 0.0002], 0.03, 1)
    assert selector.stats[0].skipped == 0  # a deferral is not a cost-based skip


def test_a_confidently_wrong_minion_stops_deferring_the_good_one():
    """An early-exit draft that is sure of wrong tokens must not keep the minion that
    is right from running: what a minion's proposals expect is scaled by how often its
    expectations came true."""
    selector = MinionSelector(["substitute", "early-exit"])
    selector.stats[0].cost, selector.stats[1].cost = 0.02, 0.001
    selector.stats[0].record = 3.0
    truth = [100, 101, 102, 103, 104, 105]
    wrong = chain([200, 201, 202, 203, 204, 205], p=0.95)
    assert not selector.still_needed(0, selector.expected(1, wrong))  # trusted while unmeasured
    for _ in range(20):
        proposals = [chain(truth), chain([200, 201, 202, 203, 204, 205], p=0.95)]
        tree = merge_greedy(1, proposals, selector.weights())
        selector.observe(tree, accepted_path(tree, truth), proposals, [0.02, 0.001], 0.1, 7)
    assert selector.stats[1].calibration < 0.05
    assert selector.still_needed(0, selector.expected(1, wrong))


def test_deferring_stops_once_the_steps_without_the_minion_accept_less():
    """Calibration lags: a half-right cheap minion can still look good enough to defer
    the substitute. What the deferred steps actually accepted decides: below what the
    substitute delivers, it is deferred no more."""
    selector = MinionSelector(["substitute", "drafter"])
    selector.stats[0].cost, selector.stats[1].cost = 0.08, 0.004
    selector.stats[0].record = 3.0
    half_right = chain([100, 201, 202, 203, 204, 205], p=0.95)  # the first token right, then wrong
    assert not selector.still_needed(0, 5.0)  # deferred while nothing says otherwise
    tree = merge_greedy(1, [None, half_right], [1.0, 1.0])
    selector.observe(tree, accepted_path(tree, [100, 101, 102]), [None, half_right], [0.0, 0.004], 0.1, 2)
    assert selector.stats[0].deferred_yield == 1.0 < selector.stats[0].record
    assert selector.still_needed(0, 5.0)  # the drafter's trees look as good as before: no longer enough
