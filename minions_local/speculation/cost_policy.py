"""A budget policy driven by the cost model, calibrated online from step records.

Plugs into the decoder like the simple policies in budget.py (`plan` before a step,
`observe_pass` after it). Each step it asks the CostModel for the tree sizes that
maximise E[accepted + 1] / (t_grow + t_verify), all requests together, and reports its
predictions, so the step record shows predicted next to measured times.

What it learns from the pass records, every `refit_every` passes over the last `window`:
- verify time: the cost model's coefficients, refit to (tree size, t_verify);
- grow time: each minion's own pass time, refit to the seconds it spent growing
  (`StepRecord.minion_t_grow`) over the passes its budget asked for, plus the
  voting overhead (what the step's grow time holds beyond the minions' own);
- participation: how often each minion ran (the selector skips minions that do not
  pay); the budget is chosen for the expected grow time, and the step record gets the
  prediction for the minions that did run;
- acceptance, separately per regime (greedy, sampled, seeded: each accepts a
  different share of the same tree): the acceptance model's numbers, the chance
  `a_d` that the best-voted child at depth d is the target's token (given that the
  path reached its parent: in repetitive text, the deeper a path got, the likelier
  it goes on) and the `decay` of each next rank, fitted by maximum likelihood to
  which child the target took at each node (StepRecord.rank_trials). They decide
  deep-narrow against shallow-wide trees.
  Records without rank trials fall back to the single rate for which the model's
  expected accepted length, summed over the trees verified, equals what was accepted.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from collections.abc import Sequence
from statistics import median

from minions_local.core.events import StepRecord
from minions_local.speculation.budget import (REGIMES, BudgetPolicy, PassRecord, StepBudget, TreeAsk, grow_shape,
                                               width_for)
from minions_local.speculation.cost import SIBLING_DECAY, CostModel, acceptance_key, accepted_by_tree_size
from minions_local.speculation.realized import RealizedRates
from minions_local.speculation.row_budget import BatchGrowCost, TreeCurve, batch_grow_seconds, split_rows


@dataclass
class CostModelBudget(BudgetPolicy):
    """The cost model's best budget under the calibrated acceptance rate."""

    uses_timed_passes = True

    model: CostModel
    min_nodes: int = 1
    max_nodes: int = 256
    max_depth: int = 16
    top_k: int = 8
    acceptance: float = 0.7
    """Starting estimate of the minions' top-1 acceptance rate, in every regime."""
    window: int = 64
    refit_every: int = 8
    probe_every: int = 16
    """When no tree pays (min_nodes = 0 lets the model say so), one step in this many
    still grows the best small tree: otherwise nothing would be measured again, and a
    stretch of text the minions predict well (a repeated code block) would go unseen.
    Until a refit has fitted a regime's rate, its steps probe: the rate is still the
    `acceptance` guess (on the 8B-shaped GGUF in RAM with a SmolLM2 minion, the guess
    kept a first chat's first 15 passes tree-less, 3 s of its 9.5, where the first
    probe then measured trees worth 1.3x a lone token), and one tree alone would
    measure it poorly."""
    _prior: CostModel | None = field(default=None, repr=False)
    _steps: deque = field(default_factory=deque, repr=False)
    """Recent (record, the budget that step was given)."""
    _seen: int = 0
    """Target passes observed."""
    realized: RealizedRates = field(default_factory=RealizedRates)
    """What shared passes realized with trees and without, per batch size."""
    _passes: deque = field(default_factory=deque, repr=False)
    """Recent passes' (draft nodes priced, seconds, requests sharing it): one sample per
    target pass."""
    _surprised: bool = False
    """A grow took far longer than predicted: refit once its pass is in."""
    _participation: dict = field(default_factory=dict, repr=False)
    _grown: dict = field(default_factory=dict, repr=False)
    """Per regime, its recent steps that verified a tree."""
    _stale: set = field(default_factory=set, repr=False)
    """Regimes with steps that arrived since their last fit."""
    _chosen: dict = field(default_factory=dict, repr=False)
    _last: StepBudget | None = field(default=None, repr=False)
    _idle: int = 0
    """Steps in a row at zero nodes (see probe_every)."""
    grow_groups: dict = field(default_factory=dict)
    """Per minion that grows a batch's trees in shared passes: requests one pass holds
    (price_batch_grows)."""
    rates: dict = field(default_factory=dict)
    """Calibrated acceptance per regime (budget.REGIMES): a rate, or one per depth."""
    decays: dict = field(default_factory=dict)
    """Calibrated sibling decay per regime."""

    def __post_init__(self) -> None:
        self._prior = self.model
        self._steps = deque(maxlen=self.window)
        self._passes = deque(maxlen=self.window)
        self.rates = {regime: self.acceptance for regime in REGIMES} | self.rates
        self.decays = {regime: SIBLING_DECAY for regime in REGIMES} | self.decays

    def choose(self, remaining_tokens: int, regime: str = "greedy") -> StepBudget:
        """One request's budget: what `plan` gives it in a pass of its own."""
        self._last = self.plan([TreeAsk(remaining_tokens, regime)])[0]
        return self._last

    def plan(self, asks: Sequence[TreeAsk | tuple]) -> list[StepBudget]:
        """Budgets for the requests of one target pass (`TreeAsk`s, or tuples of their
        fields): one row budget split between them to maximise the tokens all of them
        accept per second (row_budget.py); a lone request gets its best tree. The
        answer only changes when the model is refit or the mix of requests does: between
        refits it is reused (a search is 1-4 ms of Python, a few percent of a small step).

        A request whose minions have not read its prompt (engine/batch.py defers the
        read until a tree pays) pays that read with its first tree: the read is priced
        into its trees, spread over the steps it has left at that tree's pace."""
        if not asks:
            return []
        keys = [(max(0, min(self.max_depth, remaining - 1)), regime, _read_share(read_seconds, remaining))
                for remaining, regime, read_seconds in (TreeAsk(*ask) for ask in asks)]
        order = sorted(range(len(keys)), key=lambda i: keys[i])
        mix = tuple(keys[i] for i in order)
        if mix not in self._chosen:
            self._chosen[mix] = self._split(mix)
        budgets = self._chosen[mix]
        if any(b.nodes for b in budgets):
            self._idle = 0
            if not self.realized.admit_trees(len(mix)):  # trees lose on the clock (realized.py)
                budgets = [self._plain(len(mix))] * len(mix)
        elif any(cap for cap, _, _ in mix):
            self._idle += 1
            # A regime with a guessed rate probes now, where the probe makes no prompt be read
            # for it (a lone request is probed however it stands, as every probe_every).
            unmeasured = any(cap and (not read or len(mix) == 1) and self._guessed(regime) for cap, regime, read in mix)
            if self._idle >= self.probe_every or unmeasured:  # measure now and then (see probe_every)
                self._idle = 0
                # Probes measure acceptance, and a handful of trees measures it far
                # better than one: every request whose minions have read its context
                # grows one (it costs them growing only), and, when none has, the one
                # cheapest to read (a probe must not make 16 prompts be read).
                ready = [i for i, (cap, _, read) in enumerate(mix) if cap and not read]
                picks = ready or [min((i for i, (cap, _, _) in enumerate(mix) if cap), key=lambda i: mix[i][2])]
                budgets = list(budgets)
                for i in picks:
                    budgets[i] = self._probe(mix[i][0], mix[i][1])
        out: list[StepBudget] = [budgets[0]] * len(keys)
        for i, budget in zip(order, budgets):
            out[i] = budget
        return out

    def _guessed(self, regime: str) -> bool:
        """The regime's rate is still the starting guess: no refit fitted it (a refit fits a
        regime's participation with its rate), nor did a caller set it."""
        return regime not in self._participation and self.rates[regime] == self.acceptance

    def _plain(self, requests: int) -> StepBudget:
        """No tree, in a pass `requests` requests share."""
        return StepBudget(nodes=0, depth=0, width=1, predicted_t_verify=self.model.t_verify(requests - 1, requests),
                          predicted_t_grow=0.0)

    def _probe(self, depth_cap: int, regime: str) -> StepBudget:
        key = (depth_cap, regime, "probe")
        if key not in self._chosen:
            self._chosen[key] = self._best(depth_cap, regime, min_nodes=max(1, self.min_nodes))
        return self._chosen[key]

    def _split(self, mix: tuple[tuple[int, str, float], ...]) -> list[StepBudget]:
        """Each request weighs the trees of its lone best tree's family (that depth),
        up to that tree's size: a pass the others already pay for leaves a tree less to
        amortize, so sharing never makes a bigger tree pay than a pass of its own (and a
        request whose trees do not pay in a pass of their own decodes without one). A tree's grow time carries
        the request's unread prompt (`read_share`: seconds per token it will commit),
        times the tokens a step with that tree commits. Minions that grow the requests'
        trees in shared passes (`price_batch_grows`) are priced once a level for all.

        A lone request gets its lone best tree itself: the split's objective is then
        that tree's, which `_best` searched whole (the split's walk can stop short of it:
        60 nodes against 48 in 2 of 400 random models) and within `min_nodes` (which
        the split, free to leave a request without a tree, does not keep)."""
        if len(mix) == 1:
            cap, regime, _ = mix[0]
            return [self._own_pass_budget(cap, regime) if cap else self._plain(1)]
        curves, depth_tables, growing = [], [], []
        for cap, regime, read_share in mix:
            own = self._own_pass_budget(cap, regime) if cap else None
            if own is None or own.nodes == 0:
                curves.append(TreeCurve((0.0,), (0.0,), (0,)))
                depth_tables.append((0,))
                growing.append((0.0,))
                continue
            gains, depths = accepted_by_tree_size(acceptance_key(self.rates[regime]), own.nodes, own.depth,
                                                  self.top_k, self.decays[regime])
            own_model = self._expected_model(regime, batch_growers=False)
            grow = [0.0] + [own_model.t_grow(n, depths[n]) for n in range(1, len(gains))]
            priced = [0.0] + [grow[n] + read_share * (1 + gains[n]) for n in range(1, len(gains))]
            curves.append(TreeCurve(gains, priced, depths))
            depth_tables.append(depths)
            growing.append(grow)  # what the step record predicts: the read is not growing
        requests = len(mix)
        batch_cost = self._batch_grow_cost(tuple(regime for _, regime, _ in mix))
        nodes = split_rows(curves, lambda n: self.model.t_verify(n, requests), batch_cost)
        t_verify = self.model.t_verify(sum(nodes) + requests - 1, requests)
        growers = sum(n > 0 for n in nodes)
        batch_share = batch_grow_seconds(curves, batch_cost, nodes) / growers if growers else 0.0
        budgets = []
        for (cap, _, _), n, grow, depths in zip(mix, nodes, growing, depth_tables):
            depth = depths[n] if n else 0
            budgets.append(StepBudget(nodes=n, depth=depth, width=grow_shape(n, depth)[1] if n else 1,
                                      depth_cap=cap, predicted_t_verify=t_verify,
                                      predicted_t_grow=grow[n] + (batch_share if n else 0.0),
                                      grow_overhead=self.model.step_overhead,
                                      grow_models=() if batch_cost is not None else self.model.grow))
        return budgets

    def price_batch_grows(self, groups: dict[str, int]) -> None:
        """Minions that grow several requests' trees in one pass per tree level, and how
        many requests one pass holds (Decoder.expect_requests says so when a batch
        starts; a minion not named, or holding 1, is priced request by request)."""
        groups = {name: n for name, n in groups.items() if n > 1}
        if groups != self.grow_groups:
            self.grow_groups = groups
            self._chosen.clear()

    def _batch_grow_cost(self, regimes: tuple[str, ...]) -> BatchGrowCost | None:
        """The price of the minions that grow a batch's trees in shared passes, each
        weighted by how often it runs (the mix's regimes averaged)."""
        growers = [g for g in self.model.grow if g.name in self.grow_groups]
        if not growers:
            return None
        base = per_node = 0.0
        for regime in regimes:
            runs = self._participation.get(regime, {})
            base += sum(g.base * runs.get(g.name, 1.0) for g in growers) / len(regimes)
            per_node += sum(g.per_token * runs.get(g.name, 1.0) for g in growers) / len(regimes)
        return BatchGrowCost(base, per_node, min(self.grow_groups[g.name] for g in growers))

    def _own_pass_budget(self, depth_cap: int, regime: str) -> StepBudget:
        """The best tree for one request by itself, cached as `choose` caches it (the
        search is ~4 ms: a split of 16 requests must not redo it 16 times a pass)."""
        key = (depth_cap, regime)
        if key not in self._chosen:
            self._chosen[key] = self._best(depth_cap, regime)
        return self._chosen[key]

    def _best(self, depth_cap: int, regime: str, min_nodes: int | None = None) -> StepBudget:
        rate = self.rates[regime]
        expected = self._expected_model(regime)
        c = expected.best_budget(rate, min_nodes=self.min_nodes if min_nodes is None else min_nodes,
                                 max_nodes=self.max_nodes,
                                 max_depth=depth_cap, top_k=self.top_k, sibling_decay=self.decays[regime])
        return StepBudget(nodes=c.nodes, depth=c.depth, width=max(1, c.width), depth_cap=depth_cap,
                          predicted_t_verify=c.t_verify, predicted_t_grow=c.t_grow,
                          grow_overhead=self.model.step_overhead, grow_models=self.model.grow)

    def _expected_model(self, regime: str = "greedy", batch_growers: bool = True) -> CostModel:
        """The model with each minion's grow time weighted by how often it runs (in this
        regime: the selector learns each one apart); batch_growers=False leaves out the
        minions that grow a batch's trees in shared passes (they are priced apart)."""
        runs = self._participation.get(regime, {})
        grow = tuple(replace(g, base=g.base * p, per_token=g.per_token * p)
                     for g in self.model.grow for p in [runs.get(g.name, 1.0)]
                     if batch_growers or g.name not in self.grow_groups)
        return replace(self.model, grow=grow)

    def calibrate(self, grow_samples: dict[str, list[tuple[int, float]]],
                  verify_samples: list[tuple[int, float]] = ()) -> None:
        """Fold minions' timed passes (calibration.time_grow_passes) and the target's
        (time_verify_passes) into the prior: measured beats the profile's guess, so
        they outweigh it ten to one."""
        self._prior = self._prior.refined(verify_samples=verify_samples, grow_samples=grow_samples, weight=0.1)
        if self._steps:
            self.refit()  # the steps seen so far, over the new prior
        else:
            self.model = self._prior
        self._chosen.clear()

    def observe(self, record: StepRecord) -> None:
        """One request's step, in a pass of its own."""
        self.observe_pass(PassRecord.of(record))

    def observe_pass(self, record: PassRecord) -> None:
        """A pass is one verify sample and one step towards a refit, however many
        requests rode it (counting requests' records instead refit twice a pass at 16
        requests, each refit dropping the cached split: 76 ms of Python in a 430 ms
        pass, with the lone trees searched anew; and 4 passes filled the verify window)."""
        for step in record.steps:
            self._add_step(step)
        if record.t_step is not None and record.t_read == 0:
            self.realized.add(record.requests, record.tree_nodes > 0, record.tokens, record.t_step)
        self._passes.append((record.rows - 1, record.t_verify, max(1, record.requests)))
        self._seen += 1
        if self._seen % self.refit_every == 0 or self._surprised:
            self._surprised = False
            self.refit()

    def _add_step(self, record: StepRecord) -> None:
        """One request's step, for the grow and acceptance fits."""
        # The budget the step grew under: the decoder's records say it themselves
        # (several budgets were chosen before any of them was observed).
        budget = self._last
        if record.grow_depth is not None:
            budget = StepBudget(nodes=record.tree_size, depth=record.grow_depth, width=1)
        self._steps.append((record, budget))
        predicted = record.predicted_t_grow
        # A grow far dearer than predicted refits at once: waiting for the next regular
        # refit would pay for several more trees the model wrongly thinks are cheap.
        self._surprised |= predicted is not None and record.tree_size > 0 and record.t_grow > 2 * predicted + 0.005
        if record.tree_size > 0 and record.depth > 0:
            # Acceptance is learned from each regime's own recent trees: a run of
            # sampled requests must not push the greedy ones out of the window.
            self._grown.setdefault(record.regime, deque(maxlen=self.window)).append(record)
            self._stale.add(record.regime)

    def refit(self) -> None:
        """Recalibrate acceptance, verify and grow times from the recent steps."""
        if not self._steps:
            return
        grown = [(r, b) for r, b in self._steps if r.tree_size > 0 and b is not None and b.depth > 0]
        model = self._prior.refined(verify_samples=list(self._passes),
                                    grow_samples=grow_samples(grown))
        overheads = [r.t_grow - sum(r.minion_t_grow.values()) for r, _ in grown if r.minion_t_grow]
        if overheads:
            model = replace(model, step_overhead=max(median(overheads), 0.0))
        self.model = model
        names = [g.name for g in model.grow]
        for regime in self._stale:  # a regime with nothing new keeps its last fit
            mine = self._grown[regime]
            self._participation[regime] = {n: sum(n in r.minion_t_grow for r in mine) / len(mine) for n in names}
            trials = [t for r in mine for t in r.rank_trials]
            if trials:
                self.rates[regime], self.decays[regime] = fit_rank_acceptance(trials, self.top_k)
            else:
                self.rates[regime] = calibrate_acceptance([(r.tree_size, r.depth, r.accepted) for r in mine],
                                                          self.top_k, self.decays[regime])
        self._stale.clear()
        self._chosen.clear()


def _read_share(read_seconds: float, remaining: int) -> float:
    """A pending prompt read's seconds per token the request may still commit, on a
    10%-step grid (a cache key: the split is not redone as each step reads one token
    more or commits one token less)."""
    if read_seconds <= 0 or remaining <= 0:
        return 0.0
    return round(math.exp(round(math.log(read_seconds / remaining) * 10) / 10), 6)


def grow_samples(grown: list[tuple[StepRecord, StepBudget]]) -> dict[str, list[tuple[int, float]]]:
    """Per minion, (width, seconds per pass): the time it spent growing over the passes
    its nodes asked for (one per level of depth). A grow shared by several requests
    (StepRecord.minion_shared) is one sample of its whole passes, however many of its
    requests' records hold it."""
    out: dict[str, list[tuple[int, float]]] = {}
    seen = set()
    for record, budget in grown:
        for name, seconds in record.minion_t_grow.items():
            together = record.minion_shared.get(name)
            if together is not None:
                if (name, together) not in seen:
                    seen.add((name, together))
                    _, nodes, passes, total = together
                    out.setdefault(name, []).append((width_for(nodes, passes), total / passes))
                continue
            passes, width = grow_shape(record.minion_nodes.get(name, budget.nodes), budget.depth)
            out.setdefault(name, []).append((width, seconds / passes))
    return out


def calibrate_acceptance(trees: list[tuple[int, int, int]], top_k: int = 8,
                         sibling_decay: float = SIBLING_DECAY) -> float:
    """The rate a with sum_i E[accepted | a, nodes_i, depth_i] = sum_i accepted_i.

    trees: (nodes, depth, accepted) of verified trees. Bisection: E grows with a.
    """
    observed = sum(acc for _, _, acc in trees)
    # The best n-node tree grows best-first, so one table per depth cap serves every
    # tree size (the refit runs every few steps: keep it to a handful of table builds).
    by_depth: dict[int, list[int]] = {}
    for nodes, depth, _ in trees:
        by_depth.setdefault(depth, []).append(nodes)

    def predicted(a: float) -> float:
        total = 0.0
        for depth, sizes in by_depth.items():
            gains, _ = accepted_by_tree_size((round(a, 2),), max(sizes), depth, top_k, sibling_decay)
            total += sum(gains[min(n, len(gains) - 1)] for n in sizes)
        return total

    lo, hi = 0.01, 0.99
    if predicted(lo) >= observed:
        return lo
    if predicted(hi) <= observed:
        return hi
    for _ in range(8):  # 0.98 / 2**8 < 0.01, the cache's resolution
        mid = (lo + hi) / 2
        if predicted(mid) < observed:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 2)


def _grid(lo: float, hi: float, step: float) -> list[float]:
    return [round(lo + i * step, 4) for i in range(int(round((hi - lo) / step)) + 1)]


_COARSE_RATES = _grid(0.05, 0.95, 0.05)


def _rates_near(a: float) -> list[float]:
    """The fine grid around a coarse best rate (the fits search coarse, then fine)."""
    return _grid(max(a - 0.04, 0.02), min(a + 0.04, 0.98), 0.01)


MAX_FITTED_DEPTH = 8
"""Depths beyond this share the last fitted rate (few trees reach them)."""
MIN_TRIALS_PER_DEPTH = 12


def fit_rank_acceptance(trials: list[tuple[int, int, int]], top_k: int = 8) -> tuple[tuple[float, ...], float]:
    """((a_1, a_2, ...), decay) maximising the likelihood of which child the target took.

    Model (cost.accepted_by_tree_size): at depth d, given that ranks 1..r-1 were not the
    target's token, rank r is with probability a_d * decay**(r-1). A trial (depth,
    k offered, rank r) tested ranks 1..r (r = 0: all k, none taken). Counting per
    rank how often it was tested and taken makes each likelihood a product over at
    most top_k ranks: the decay is fitted over all depths, then each depth's a_d (a
    depth with few trials takes the rate of all depths).
    """
    overall = _rank_counts(trials, top_k)
    if not overall:
        return (0.7,), SIBLING_DECAY
    if len(overall) == 1:  # chains only: nothing says how siblings compare
        _, hit, miss = overall[0]
        return (min(max((hit + 0.5) / (hit + miss + 1), 0.02), 0.98),), SIBLING_DECAY
    a_all, decay = _best_pair(overall)
    rates = []
    for depth in range(1, MAX_FITTED_DEPTH + 1):
        mine = [t for t in trials if t[0] == depth] if depth < MAX_FITTED_DEPTH else \
            [t for t in trials if t[0] >= depth]
        if len(mine) < MIN_TRIALS_PER_DEPTH:
            break
        counts = _rank_counts(mine, top_k)
        coarse = max(_COARSE_RATES, key=lambda a: _log_likelihood(counts, a, decay))
        rates.append(max(_rates_near(coarse), key=lambda a: _log_likelihood(counts, a, decay)))
    return tuple(rates) or (a_all,), decay


def _best_pair(counts: list[tuple[int, int, int]]) -> tuple[float, float]:
    """Grid search, coarse then fine around the best: ~300 likelihoods, not ~1000
    (the policy refits every few steps)."""
    a0, d0 = max(((a, d) for a in _COARSE_RATES for d in _grid(0.1, 0.9, 0.1)),
                 key=lambda ad: _log_likelihood(counts, *ad))
    fine = [(a, d) for a in _rates_near(a0) for d in _grid(max(d0 - 0.1, 0.05), min(d0 + 0.1, 0.95), 0.025)]
    return max(fine, key=lambda ad: _log_likelihood(counts, *ad))


def _rank_counts(trials: list[tuple[int, int, int]], top_k: int) -> list[tuple[int, int, int]]:
    """(rank, times taken, times tested and passed over) for each rank ever tested."""
    tested = [0] * (top_k + 1)
    taken = [0] * (top_k + 1)
    for _, offered, rank in trials:
        for i in range(1, min(rank or offered, top_k) + 1):
            tested[i] += 1
        if 0 < rank <= top_k:
            taken[rank] += 1
    return [(i, taken[i], tested[i] - taken[i]) for i in range(1, top_k + 1) if tested[i]]


def _log_likelihood(counts: list[tuple[int, int, int]], a: float, decay: float) -> float:
    ll = 0.0
    for i, hit, miss in counts:
        p = a * decay ** (i - 1)
        ll += hit * math.log(p) + miss * math.log1p(-p)
    return ll
