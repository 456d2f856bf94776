"""The cost model: monotone predictions, sensible budgets, refits that recover the truth."""

from __future__ import annotations

import math
import random

import pytest

from minions_local.planning.cost_prior import budget_from_profile, cost_model_from_profile
from minions_local.profile import load_profile
from minions_local.speculation.cost import CostModel, GrowTime, VerifyTime, accepted_by_tree_size


def streamed_model() -> CostModel:
    return cost_model_from_profile(load_profile("rtx4090-70b"))


def test_verify_time_is_flat_while_streaming_dominates_then_grows():
    model = streamed_model()
    times = [model.t_verify(n) for n in range(0, 2049, 16)]
    assert all(b >= a for a, b in zip(times, times[1:]))
    assert model.t_verify(0) == model.t_verify(256)  # 22 GB over PCIe hides 257 tokens of compute
    assert model.t_verify(4096) > model.t_verify(256)
    p = model.parts
    assert p["stream"] == pytest.approx(p["stream_ram"])
    assert 0.7 < p["stream"] < 1.2  # ~23 GB at 25 GB/s
    assert model.t_verify(0) == pytest.approx(p["overhead"] + p["stream"])


def test_grow_time_counts_one_pass_per_level():
    g = GrowTime("m", base=0.01, per_token=0.001)
    assert g(0, 4) == 0.0
    assert g(32, 4) == pytest.approx(4 * (0.01 + 0.001 * 8))
    assert g(32, 4, width=4) == pytest.approx(8 * (0.01 + 0.001 * 4))  # narrower: more passes
    assert g(2, 4) == pytest.approx(2 * (0.01 + 0.001))  # never more levels than nodes
    assert g(64, 8) > g(32, 8) > g(32, 4)


def test_chain_expectation_is_the_geometric_sum():
    gains, depths = accepted_by_tree_size((0.8,), 10, max_depth=16, top_k=1)
    for n in range(11):
        assert gains[n] == pytest.approx(sum(0.8**i for i in range(1, n + 1)))
        assert depths[n] == n


def test_tree_expectation_grows_with_diminishing_returns():
    gains, depths = accepted_by_tree_size((0.7,), 256, max_depth=16, top_k=8)
    steps = [b - a for a, b in zip(gains, gains[1:])]
    assert all(s > 0 for s in steps)
    assert all(b <= a + 1e-12 for a, b in zip(steps, steps[1:]))  # best-first: each node adds less
    assert gains[256] > sum(0.7**i for i in range(1, 17)) * 0.9  # branching beats a 16-chain's bound...
    assert gains[256] < 16  # ...but never exceeds the depth cap
    assert max(depths) <= 16 and depths == tuple(sorted(depths))
    capped, cdepths = accepted_by_tree_size((0.7,), 256, max_depth=3, top_k=8)
    assert max(cdepths) <= 3 and capped[-1] < gains[-1]


def test_per_depth_acceptance_and_higher_rates_help():
    falling, _ = accepted_by_tree_size((0.9, 0.5), 64)
    flat, _ = accepted_by_tree_size((0.9,), 64)
    assert falling[64] < flat[64]
    model = streamed_model()
    at_128 = [model.best_budget(a, min_nodes=128, max_nodes=128) for a in (0.5, 0.6, 0.7, 0.8, 0.9)]
    assert [c.tokens_per_second for c in at_128] == sorted(c.tokens_per_second for c in at_128)
    assert model.best_budget([0.9, 0.8, 0.7], min_nodes=128, max_nodes=128).tokens_per_second > 0


def test_best_budget_is_the_argmax_and_grows_with_acceptance():
    model = streamed_model()
    choices = [model.best_budget(a, max_nodes=256, max_depth=16) for a in (0.5, 0.7, 0.9)]
    assert [c.expected_accepted for c in choices] == sorted(c.expected_accepted for c in choices)
    assert [c.tokens_per_second for c in choices] == sorted(c.tokens_per_second for c in choices)
    best = choices[1]
    for n in (1, 8, 32, 64, 128, 256):  # no fixed budget beats the choice
        fixed = model.best_budget(0.7, min_nodes=n, max_nodes=n, max_depth=16)
        assert fixed.nodes == n and fixed.tokens_per_second <= best.tokens_per_second * (1 + 1e-9)
    assert best.width == math.ceil(best.nodes / best.depth)
    assert best.tokens_per_second == pytest.approx(best.tokens_per_step / (best.t_grow + best.t_verify))


def test_streaming_makes_big_trees_pay_and_compute_bound_keeps_them_small():
    streamed = streamed_model().best_budget(0.8, max_nodes=256)
    # Resident, compute-bound target: each extra token costs as much as a whole pass / 10.
    compute_bound = CostModel(VerifyTime(flat=0.01, base=0.0, slope=0.001), (GrowTime("m", 0.002, 0.0),))
    small = compute_bound.best_budget(0.8, max_nodes=256)
    assert streamed.nodes >= 128
    assert small.nodes < 32
    assert streamed.expected_accepted > small.expected_accepted


def test_best_budget_respects_limits():
    model = streamed_model()
    c = model.best_budget(0.95, min_nodes=4, max_nodes=40, max_depth=5)
    assert 4 <= c.nodes <= 40 and c.depth <= 5
    c = CostModel(VerifyTime(0.01, 0.0, 1.0)).best_budget(0.5, min_nodes=0)
    assert c.nodes == 0  # verifying anything costs more than it can win


def test_refit_recovers_a_hinge_from_samples():
    truth = VerifyTime(flat=0.5, base=0.05, slope=0.002)
    prior = VerifyTime(flat=1.0, base=0.02, slope=0.001)
    rng = random.Random(0)
    samples = [(n, truth(n) * rng.uniform(0.97, 1.03)) for n in (1, 8, 32, 64, 128, 256, 384, 512) * 4]
    fitted = CostModel(prior).refined(verify_samples=samples).verify
    assert fitted.flat == pytest.approx(0.5, rel=0.05)
    assert fitted.slope == pytest.approx(0.002, rel=0.15)
    for n in (16, 300, 500):
        assert fitted(n) == pytest.approx(truth(n), rel=0.06)


def test_a_one_row_pass_is_fitted_apart_from_the_line():
    """A CPU's one-row pass runs another kernel path (cpu-demo-disk, AVX2: 212 ms, then
    346 for 8 rows, 367 for 16, 405 for 32): the line's slope comes from the tree
    passes, not from the jump between one row and eight."""
    samples = [(0, 0.212), (7, 0.346), (15, 0.367), (31, 0.405)] * 4
    fitted = CostModel(VerifyTime(flat=0.1, base=0.1, slope=0.001)).refined(verify_samples=samples).verify
    assert fitted(0) == pytest.approx(0.212, rel=0.05)
    assert fitted.slope < 0.0045  # ~2.5 ms a row, not (346 - 212) / 7 = 19
    assert fitted(15) == pytest.approx(0.367, rel=0.03)
    assert VerifyTime(0.3, 0.0, 0.001)(0) == 0.3  # nothing measured alone: the line holds


def test_refit_tells_a_shared_pass_requests_from_its_rows():
    """Each request sharing a pass adds its own attention; fitted apart, the line keeps
    the cost of a row, and a split of k requests prices its nodes at that."""
    truth = VerifyTime(flat=0.0, base=0.3, slope=0.003)

    def seconds(nodes, requests):
        return truth(nodes) + 0.005 * (requests - 1)

    samples = [(n, seconds(n, 1)) for n in (3, 7, 15, 31)]
    samples += [(k - 1 + extra, seconds(k - 1 + extra, k), k) for k in (4, 8, 16) for extra in (0, 8, 24)]
    model = CostModel(VerifyTime(flat=0.0, base=0.2, slope=0.001)).refined(verify_samples=samples * 2)
    assert model.per_request == pytest.approx(0.005, rel=0.15)
    assert model.verify.slope == pytest.approx(0.003, rel=0.1)
    assert model.t_verify(31, 8) == pytest.approx(seconds(31, 8), rel=0.02)
    lumped = CostModel(VerifyTime(flat=0.0, base=0.2, slope=0.001)).refined(
        verify_samples=[(n, t) for n, t, *_ in samples * 2])
    assert lumped.verify.slope > 0.0035  # one line through both: rows look dearer than they are


def test_refit_keeps_the_prior_where_samples_say_nothing():
    prior = VerifyTime(flat=1.0, base=0.02, slope=0.001)
    fitted = prior.fit([(8, 0.8), (16, 0.8), (32, 0.8)])
    assert 0.8 <= fitted.flat < 0.85  # three samples pull the flat part most of the way
    assert fitted.slope == prior.slope and fitted.base == prior.base  # knee never observed


def test_refit_grow_line_and_unknown_names_are_ignored():
    model = CostModel(VerifyTime(1, 0, 0.001), (GrowTime("a", 0.01, 0.001), GrowTime("b", 0.02, 0.0)))
    samples = {"a": [(w, 0.004 + 0.0005 * w) for w in (1, 4, 16, 64)], "zzz": [(1, 9.0)]}
    refined = model.refined(grow_samples=samples)
    a, b = refined.grow
    for w in (1, 8, 64):
        assert a.pass_seconds(w) == pytest.approx(0.004 + 0.0005 * w, rel=0.1)
    assert b == model.grow[1]
    assert model.grow[0].base == 0.01  # pure: the original is untouched


# -- the budget policy built on the cost model ------------------------------------------------

from minions_local.core.events import StepRecord  # noqa: E402
from minions_local.speculation.budget import PassRecord  # noqa: E402
from minions_local.speculation.cost_policy import CostModelBudget, calibrate_acceptance  # noqa: E402


def simulate_accepted(rng, a, nodes, depth, top_k=8):
    """Draw an accepted length whose mean follows the acceptance model (chain of coin flips
    with the tree's per-depth coverage)."""
    gains, _ = accepted_by_tree_size((a,), nodes, depth, top_k)
    mean = gains[min(nodes, len(gains) - 1)]
    # a geometric-like draw truncated at depth, scaled to the model's mean
    p = mean / (1 + mean)
    k = 0
    while k < depth and rng.random() < p:
        k += 1
    return k


def test_calibrated_acceptance_recovers_the_rate():
    for a in (0.5, 0.8):
        trees = []
        for nodes, depth in [(16, 4), (64, 8), (128, 12)] * 20:
            gains, _ = accepted_by_tree_size((a,), nodes, depth)
            trees.append((nodes, depth, round(gains[nodes])))
        assert calibrate_acceptance(trees) == pytest.approx(a, abs=0.04)


def test_policy_learns_the_machine_and_the_minions():
    truth = VerifyTime(flat=0.4, base=0.01, slope=0.002)  # the real machine: faster link than the prior
    prior_grow = GrowTime("m", 0.005, 0.0001)
    prior = CostModel(VerifyTime(flat=1.0, base=0.02, slope=0.001), (prior_grow,))
    policy = CostModelBudget(prior, max_nodes=256, max_depth=12, acceptance=0.5, refit_every=4)
    rng = random.Random(1)
    for _ in range(64):
        b = policy.choose(remaining_tokens=1000)
        assert b.predicted_t_verify is not None and 0 <= b.nodes <= 256 and b.depth <= 12
        accepted = simulate_accepted(rng, 0.8, b.nodes, b.depth)
        minion = 2 * prior_grow(b.nodes, b.depth, b.width)  # the minion is twice as slow as the prior says
        policy.observe(StepRecord(tree_size=b.nodes, accepted=accepted, t_grow=minion + 0.003,
                                  t_verify=truth(b.nodes), depth=b.depth, minion_t_grow={"m": minion},
                                  predicted_t_verify=b.predicted_t_verify,
                                  predicted_t_grow=b.predicted_grow_for({"m": b.nodes})))
    assert policy.rates["greedy"] == pytest.approx(0.8, abs=0.12)
    assert policy.model.t_verify(64) == pytest.approx(truth(64), rel=0.1)
    for width in (1, 4, 16):
        assert policy.model.grow[0].pass_seconds(width) == pytest.approx(2 * prior_grow.pass_seconds(width),
                                                                         rel=0.1)
    assert policy.model.step_overhead == pytest.approx(0.003, rel=0.05)  # voting: grow time beyond the minions'
    b = policy.choose(remaining_tokens=1000)
    assert b.predicted_grow_for({"m": b.nodes}) == pytest.approx(0.003 + 2 * prior_grow(b.nodes, b.depth, b.width), rel=0.1)
    assert b.predicted_grow_for({}) == pytest.approx(0.003, rel=0.05)
    share = b.predicted_grow_for({"m": max(1, b.nodes // 4)})  # a sampled step grows a share
    assert b.predicted_grow_for({}) < share < b.predicted_grow_for({"m": b.nodes})
    b = policy.choose(remaining_tokens=3)
    assert b.depth <= 2  # never grow deeper than the tokens still wanted
    assert policy.choose(remaining_tokens=1).nodes == 0


def test_policy_calibrates_greedy_and_sampled_requests_apart():
    """Sampling accepts less from the same trees; one shared rate would be wrong for both."""
    prior = CostModel(VerifyTime(flat=0.05, base=0.01, slope=0.0005), (GrowTime("m", 0.002, 0.0001),))
    policy = CostModelBudget(prior, max_nodes=128, max_depth=12, acceptance=0.5, refit_every=4)
    rng = random.Random(2)
    for i in range(128):
        sampled = i % 2 == 1
        b = policy.choose(remaining_tokens=1000, regime="sampled" if sampled else "greedy")
        gains, _ = accepted_by_tree_size((0.3 if sampled else 0.85,), b.nodes, b.depth)
        mean = gains[min(b.nodes, len(gains) - 1)]  # a draw with exactly the model's mean
        accepted = int(mean) + (rng.random() < mean - int(mean))
        policy.observe(StepRecord(tree_size=b.nodes, accepted=accepted, t_grow=0.01, t_verify=prior.t_verify(b.nodes),
                                  depth=b.depth, regime="sampled" if sampled else "greedy", minion_t_grow={"m": 0.009}))
    assert policy.rates["greedy"] == pytest.approx(0.85, abs=0.08)
    assert policy.rates["sampled"] == pytest.approx(0.3, abs=0.08)
    assert policy.rates["seeded"] == 0.5  # no seeded steps seen: still the starting estimate
    greedy, sampled = policy.choose(1000), policy.choose(1000, regime="sampled")
    assert sampled.nodes < greedy.nodes  # less is accepted, so a smaller tree pays


def test_policy_budgets_for_the_minions_that_actually_run():
    """A minion the selector rarely runs should barely count in the chosen budget's grow time."""
    prior = CostModel(VerifyTime(flat=0.02, base=0.01, slope=0.0005),
                      (GrowTime("cheap", 0.0005, 0.0), GrowTime("slow", 0.01, 0.0005)))
    policy = CostModelBudget(prior, max_nodes=64, max_depth=8, acceptance=0.7, refit_every=4)
    for i in range(32):
        b = policy.choose(1000)
        ran = {"cheap": 0.0005 * b.depth} | ({"slow": 0.01 * b.depth} if i % 8 == 0 else {})
        policy.observe(StepRecord(tree_size=b.nodes, accepted=2, t_grow=sum(ran.values()), t_verify=0.02,
                                  depth=b.depth, minion_t_grow=ran))
    b = policy.choose(1000)
    each = {g.name: g(b.nodes, b.depth, b.width) for g in b.grow_models}
    assert b.predicted_t_grow < b.grow_overhead + each["cheap"] + 0.5 * each["slow"]
    assert b.predicted_grow_for({"cheap": b.nodes}) == pytest.approx(b.grow_overhead + each["cheap"])


def test_policy_from_profile_uses_its_limits():
    policy = budget_from_profile(load_profile("rtx4090-70b"))
    assert (policy.min_nodes, policy.max_nodes, policy.max_depth) == (8, 512, 24)
    b = policy.choose(100)
    assert b.nodes >= 128  # streamed 70B: large trees pay


def test_autotune_measurements_replace_the_guesses():
    from minions_local.profile.schema import Measurements, TimingSample

    profile = load_profile("stdlib-demo")
    guess = cost_model_from_profile(profile)
    grow = [TimingSample(model="minion-llama-s", tokens=w, seconds=0.01 + 0.002 * w) for w in (1, 4, 16)]
    layer = [TimingSample(model="target", tokens=t, seconds=0.001 + 0.0001 * t) for t in (1, 16, 64)]
    profile.measurements = Measurements(grow=grow, target_layer=layer)
    measured = cost_model_from_profile(profile)
    g = next(g for g in measured.grow if g.name == "minion-llama-s")
    assert g.pass_seconds(8) == pytest.approx(0.01 + 0.002 * 8, rel=0.05)
    assert measured.verify.slope == pytest.approx(6 * 0.0001, rel=0.01)  # per layer x 6 layers
    assert measured.t_verify(0) >= 6 * 0.0011
    assert measured.verify != guess.verify


def simulate_trials(rng, a, decay, n, offered=8, depth=1):
    """Which child the target takes at n nodes, under the model's own rank law."""
    trials = []
    for _ in range(n):
        taken = 0
        for rank in range(1, offered + 1):
            if rng.random() < a * decay ** (rank - 1):
                taken = rank
                break
        trials.append((depth, offered, taken))
    return trials


def test_rank_acceptance_is_fitted_from_which_child_the_target_took():
    from minions_local.speculation.cost_policy import fit_rank_acceptance

    rng = random.Random(4)
    for a, decay in [(0.8, 0.2), (0.5, 0.7), (0.3, 0.5)]:
        (fa,), fd = fit_rank_acceptance(simulate_trials(rng, a, decay, 3000))
        assert fa == pytest.approx(a, abs=0.05) and fd == pytest.approx(decay, abs=0.12)
    # a path that got deep is likelier to go on (repetitive text): one rate per depth
    trials = simulate_trials(rng, 0.5, 0.3, 2000) + simulate_trials(rng, 0.9, 0.3, 2000, depth=2)
    rates, decay = fit_rank_acceptance(trials)
    assert rates == (pytest.approx(0.5, abs=0.05), pytest.approx(0.9, abs=0.05)) and decay == pytest.approx(0.3, abs=0.12)


def test_siblings_that_rarely_win_make_the_policy_grow_narrower_trees():
    # Every verified node costs (no flat region to fill for free), growing is cheap.
    prior = CostModel(VerifyTime(flat=0.0, base=0.01, slope=0.0003), (GrowTime("m", 0.0002, 0.00001),))
    depths = {}
    for decay in (0.1, 0.9):
        policy = CostModelBudget(prior, max_nodes=64, max_depth=16, acceptance=0.6, refit_every=4)
        rng = random.Random(5)
        for _ in range(8):
            b = policy.choose(1000)
            policy.observe(StepRecord(tree_size=b.nodes, accepted=1, t_grow=0.002, t_verify=prior.t_verify(b.nodes),
                                      depth=b.depth, minion_t_grow={"m": 0.0019},
                                      rank_trials=simulate_trials(rng, 0.6, decay, 40)))
        assert policy.decays["greedy"] == pytest.approx(decay, abs=0.15)
        assert policy.rates["greedy"] == (pytest.approx(0.6, abs=0.1),)
        b = policy.choose(1000)
        depths[decay] = b.nodes / b.depth  # nodes per level
    assert depths[0.1] <= 1.5 < 2 <= depths[0.9]  # (nearly) a chain, against a bushy tree


def test_rank_trials_read_the_verified_tree():
    from minions_local.speculation.accept import rank_trials
    from minions_local.core.tree import TokenTree

    tree = TokenTree.from_root(1)
    a = tree.add(0, 10, 0.6)
    b = tree.add(0, 11, 0.3)
    c = tree.add(a, 12, 0.2)
    tree.add(a, 13, 0.4)
    assert rank_trials(tree, [0, b]) == [(1, 2, 2)]  # the leaf b offered nothing after
    assert rank_trials(tree, [0, a, c]) == [(1, 2, 1), (2, 2, 2)]
    assert rank_trials(tree, [0, a]) == [(1, 2, 1), (2, 2, 0)]
    assert rank_trials(tree, [0, a], capped=True) == [(1, 2, 1)]  # a length limit is no rejection


def test_when_no_tree_pays_the_policy_decodes_alone_and_probes_now_and_then():
    """Verifying is compute-bound and growing costs more than it saves: min_nodes = 0
    lets the policy say so, and one step in probe_every still grows, so a stretch the
    minions predict well can win the trees back. Until the first refit every step probes:
    the acceptance is still a guess (and one regime's trees do not measure another's)."""
    prior = CostModel(VerifyTime(flat=0.02, base=0.02, slope=0.002), (GrowTime("m", 0.012, 0.0005),))
    policy = CostModelBudget(prior, min_nodes=0, max_nodes=64, max_depth=8, acceptance=0.5, probe_every=8,
                             window=8)
    chosen = []
    for _ in range(32):  # the minion is never right
        b = policy.choose(1000)
        chosen.append(b.nodes)
        policy.observe(StepRecord(tree_size=b.nodes, accepted=0, t_grow=prior.t_grow(b.nodes, b.depth),
                                  t_verify=prior.t_verify(b.nodes), depth=b.depth,
                                  minion_t_grow={"m": prior.t_grow(b.nodes, b.depth)} if b.nodes else {},
                                  rank_trials=[(1, 1, 0)] if b.nodes else []))
    assert chosen[:8] == [chosen[0]] * 8 and chosen[0] > 0  # until the first refit (refit_every)
    assert chosen[8:].count(0) == 21 and all(chosen[i] > 0 for i in (15, 23, 31))
    assert policy.choose(1000, "sampled").nodes > 0
    # The probes find the minion right every time: trees pay again once they outweigh the
    # misses in the window.
    for _ in range(56):
        b = policy.choose(1000)
        grow = prior.t_grow(b.nodes, b.depth)
        policy.observe(StepRecord(tree_size=b.nodes, accepted=b.depth, t_grow=grow, t_verify=prior.t_verify(b.nodes),
                                  depth=b.depth, minion_t_grow={"m": grow} if b.nodes else {},
                                  rank_trials=[(d, 1, 1) for d in range(1, b.depth + 1)]))
    assert policy.choose(1000).nodes > 0


def test_a_grow_far_dearer_than_predicted_refits_at_once():
    """Waiting refit_every steps would pay for more trees the model wrongly thinks cheap."""
    policy = CostModelBudget(CostModel(VerifyTime(flat=0.05, base=0.05, slope=0.0001), (GrowTime("m", 0.001, 0.0001),)),
                             max_nodes=64, refit_every=64)
    b = policy.choose(1000)
    measured = 10 * b.predicted_t_grow + 0.01
    policy.observe(StepRecord(tree_size=b.nodes, accepted=1, t_grow=measured, t_verify=0.05, depth=b.depth,
                              minion_t_grow={"m": measured}, predicted_t_grow=b.predicted_t_grow))
    assert policy.model.grow[0].pass_seconds(b.width) > 2 * GrowTime("m", 0.001, 0.0001).pass_seconds(b.width)
    assert policy.choose(1000).nodes < b.nodes


def test_a_shared_pass_is_one_step_of_the_refit_and_one_verify_sample():
    """16 requests' records of one pass refit no sooner than 1 record would, and the
    pass's time enters the verify fit once (not 16 times, crowding out older passes)."""
    prior = CostModel(VerifyTime(flat=0.3, base=0.2, slope=0.004), (GrowTime("m", 0.01, 0.0002),))
    policy = CostModelBudget(prior, max_nodes=32, max_depth=8, refit_every=4)
    refits = []
    policy.refit = lambda: refits.append(len(policy._passes))  # type: ignore[method-assign]

    def shared_pass(k: int, rows: int, seconds: float) -> None:
        steps = [StepRecord(tree_size=rows // k - 1, accepted=0, t_grow=0.01, t_verify=seconds,
                            depth=1, batch_size=k, pass_rows=rows, minion_t_grow={"m": 0.009}) for _ in range(k)]
        policy.observe_pass(PassRecord(tuple(steps), seconds, rows))

    for i in range(3):
        shared_pass(16, 32, 0.5)
    assert refits == [] and len(policy._passes) == 3
    shared_pass(16, 32, 0.5)
    assert refits == [4]  # the 4th pass, as 4 lone steps would
    for i in range(3):
        shared_pass(1, 4, 0.3)
    shared_pass(1, 4, 0.3)
    assert refits == [4, 8]
    assert list(policy._passes)[:4] == [(31, 0.5, 16)] * 4
