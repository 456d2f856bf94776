"""Timing the minions at load: the cost model starts from their real price per pass."""

from __future__ import annotations

import pytest

from minions_local.core.minion import BaseMinion
from minions_local.core.protocols import CandidateTree
from minions_local.speculation.budget import FixedBudget, grow_shape
from minions_local.speculation.calibration import calibrate_policy, time_grow_passes
from minions_local.speculation.cost import CostModel, GrowTime, VerifyTime
from minions_local.speculation.cost_policy import CostModelBudget

BASE, PER_TOKEN = 0.004, 0.0005


class Clock:
    """The seconds the priced fakes below spend, kept exactly: real sleeps overshoot by
    milliseconds on a busy machine, which is the size of what these tests compare."""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now

    @classmethod
    def sleep(cls, seconds: float) -> None:
        cls.now += seconds


@pytest.fixture(autouse=True)
def exact_clock(monkeypatch):
    import minions_local.speculation.timing as timing

    monkeypatch.setattr(timing, "time", Clock)


class PricedMinion(BaseMinion):
    """Each pass costs BASE + PER_TOKEN * width, one pass per level, like a model minion."""

    vocab_size = 100
    grows_ahead = False

    def __init__(self, name="priced", free=False):
        self.name, self.depth_is_free = name, free
        self.contexts, self.resets = [], 0

    def prefill(self, context):
        pass

    def grow(self, context, budget):
        self.contexts.append(list(context))
        passes, width = grow_shape(budget.max_nodes, budget.max_depth)
        Clock.sleep(passes * (BASE + PER_TOKEN * width))
        return CandidateTree()

    def grow_ahead(self, budget, window):
        return 0

    def commit(self, accepted):
        pass

    def reset(self):
        self.resets += 1


def test_timed_passes_are_per_pass_and_leave_the_minion_reset():
    minion = PricedMinion()
    samples = time_grow_passes(minion, vocab=100)
    assert [w for w, _ in samples] == [1, 8, 16]
    for width, seconds in samples:
        assert seconds == pytest.approx(BASE + PER_TOKEN * width)
    # Each timed grow follows a longer context, as a decoding step would.
    assert all(len(b) > len(a) for a, b in zip(minion.contexts[1:], minion.contexts[2:]))
    assert minion.resets == 1 and all(t < 100 for c in minion.contexts for t in c)


def test_a_cost_model_policy_starts_from_the_timed_price():
    cheap_guess = GrowTime("priced", base=0.0002, per_token=0.00001)  # the profile's physics, 20x off
    policy = CostModelBudget(CostModel(VerifyTime(flat=0.02, base=0.02, slope=0.0001),
                                       (cheap_guess, GrowTime("ngram", 0.0002, 0.0))), max_nodes=64)
    before = policy.choose(1000)
    free = PricedMinion("ngram", free=True)
    samples = calibrate_policy(policy, [PricedMinion(), free], vocab=100)
    assert set(samples) == {"priced"} and free.contexts == []  # depth-free minions cost nothing to time
    grow = {g.name: g for g in policy.model.grow}["priced"]
    assert grow.pass_seconds(8) == pytest.approx(BASE + 8 * PER_TOKEN, rel=0.5)
    assert policy.choose(1000).nodes < before.nodes  # a dearer minion: a smaller tree


def test_other_policies_are_left_alone():
    minion = PricedMinion()
    assert calibrate_policy(FixedBudget(nodes=8, depth=2), [minion], vocab=100) == {}
    assert minion.contexts == []


def test_timing_is_reported_as_loading_progress():
    policy = CostModelBudget(CostModel(VerifyTime(flat=0.02, base=0.02, slope=0.0001),
                                       (GrowTime("priced", 0.001, 0.0001),)))
    events = []
    calibrate_policy(policy, [PricedMinion()], vocab=100, progress=events.append)
    assert [(e.model, e.done_bytes, e.total_bytes) for e in events] == [("priced", 0, 1), ("priced", 1, 1)]
    assert "timing" in events[0].message


FLAT, PER_NODE = 0.004, 0.0004


class PricedTarget:
    """A target whose pass costs FLAT + PER_NODE * draft nodes: compute-bound trees, where
    a profile's physics may have called them free."""

    vocab_size = 100

    def __init__(self):
        self.trees, self.resets = [], 0

    def prefill(self, context):
        self.context = list(context)

    def verify(self, context, tree):
        assert context == self.context and tree.tokens[0] == context[-1]
        self.trees.append(tree.draft_size)
        Clock.sleep(FLAT + PER_NODE * tree.draft_size)

    def reset(self):
        self.resets += 1


def test_the_targets_pass_is_timed_at_several_tree_sizes_and_slopes_the_prior():
    from minions_local.speculation.calibration import VERIFY_SIZES, time_verify_passes

    target = PricedTarget()
    samples = time_verify_passes(target, vocab=100)
    assert [n for n, _ in samples] == list(VERIFY_SIZES) and target.trees == [VERIFY_SIZES[0], *VERIFY_SIZES]
    assert target.resets == 1
    for nodes, seconds in samples:
        assert seconds == pytest.approx(FLAT + PER_NODE * nodes)
    # A target whose first pass costs what any does is timed from its first pass, below a
    # 1-token context that needs no read (at 8B under a memory limit, each pass is seconds).
    cold = PricedTarget()
    assert [n for n, _ in time_verify_passes(cold, vocab=100, warm_up=False)] == list(VERIFY_SIZES)
    assert cold.trees == list(VERIFY_SIZES) and len(cold.context) == 1
    # Passes the target already ran at load, of several sizes, are taken as they are.
    ran = [(0, 0.005), (11, 0.009), (78, 0.035)]
    untimed = PricedTarget()
    got = calibrate_policy(CostModelBudget(CostModel(VerifyTime(flat=0.005, base=0.001, slope=0.000001),
                                                     (GrowTime("ngram", 0.0002, 0.0),))),
                           [PricedMinion("ngram", free=True)], vocab=100, target=untimed, target_timed=ran)
    assert got == {"target": ran} and untimed.trees == []
    # A prior that thinks trees are free (a read-bound pass that is not) picks a big tree;
    # timed, the same policy sees each node's price and picks a smaller one.
    free_trees = CostModel(VerifyTime(flat=0.005, base=0.001, slope=0.000001), (GrowTime("ngram", 0.0002, 0.0),))
    before = CostModelBudget(free_trees, max_nodes=64).choose(1000)
    policy = CostModelBudget(free_trees, max_nodes=64)
    samples = calibrate_policy(policy, [PricedMinion("ngram", free=True)], vocab=100, target=PricedTarget())
    assert set(samples) == {"target"}
    assert policy.model.t_verify(48) == pytest.approx(FLAT + PER_NODE * 49, rel=0.3)
    assert policy.choose(1000).nodes < before.nodes
    # No minions, no trees: the target is not timed.
    assert calibrate_policy(CostModelBudget(free_trees), [], vocab=100, target=(quiet := PricedTarget())) == {}
    assert quiet.trees == []


def test_a_target_whose_new_shapes_cost_more_is_timed_on_each_sizes_second_pass():
    """A split target (backends/llama_remote.py) asks its servers allocation sizes on the
    first pass of a row count: that pass is not what decoding pays, so it goes untimed."""
    from minions_local.speculation.calibration import VERIFY_SIZES, time_verify_passes

    target = PricedTarget()
    samples = time_verify_passes(target, vocab=100, repeats=2)  # the engine's choice for a split target
    assert target.trees == [VERIFY_SIZES[0]] + [n for n in VERIFY_SIZES for _ in range(2)]  # the untimed one once
    assert [n for n, _ in samples] == list(VERIFY_SIZES)
    plain = PricedTarget()
    time_verify_passes(plain, vocab=100)
    assert plain.trees == [VERIFY_SIZES[0], *VERIFY_SIZES]  # one pass a size elsewhere


def test_a_cut_times_one_pass_a_size_after_an_untimed_one():
    """A llama.cpp target in memory: its cut's passes (llama_check_model.py) say what its
    own passes cost once scaled to its size, with no pass of the model at load."""
    from minions_local.speculation.calibration import VERIFY_SIZES, time_pass_shape

    class Cut(PricedTarget):  # the same kernels on fewer layers: a tenth of the price
        def verify(self, context, tree):
            Clock.sleep((FLAT + PER_NODE * tree.draft_size) / 10)
            self.trees.append(tree.draft_size)

    cut = Cut()
    shape = time_pass_shape(cut, budget_s=1.0)
    assert cut.trees == [0] + [n for n in VERIFY_SIZES for _ in range(5)]  # 5 a size: cheap ones
    assert [n for n, _ in shape] == list(VERIFY_SIZES)
    for nodes, seconds in shape:
        assert seconds == pytest.approx((FLAT + PER_NODE * nodes) / 10)
    dear = Cut()
    time_pass_shape(dear, budget_s=1e-9)  # past the budget: two passes a size, still not one
    assert dear.trees == [0] + [n for n in VERIFY_SIZES for _ in range(2)]


def test_a_size_s_price_is_its_least_pass():
    """One pass in a round that another process slowed prices every tree of that size."""
    from minions_local.speculation.calibration import time_verify_passes

    class Hiccup(PricedTarget):
        def verify(self, context, tree):
            super().verify(context, tree)
            if self.trees.count(4) == 1 and tree.draft_size == 4:  # the first 4-node pass
                Clock.sleep(1.0)

    target = Hiccup()
    samples = time_verify_passes(target, vocab=100, repeats=3)
    assert all(seconds == pytest.approx(FLAT + PER_NODE * nodes) for nodes, seconds in samples)
    assert dict(time_verify_passes(Hiccup(), vocab=100))[4] > 1.0  # one pass: priced at it
