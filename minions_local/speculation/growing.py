"""The minions grow one step's proposals, for every request the step serves.

Each request's minions grow in its selector's order, cheapest first, and a costly
minion is skipped when the proposals so far already expect more accepted tokens than
it usually adds (selection.py `still_needed`). With several requests in one step,
growing goes in rounds: each round, every request's next minion grows, and a minion
that can (`grows_batches`: llama.cpp decoding several requests' sequences in one pass)
grows all the requests that asked for it at once, one pass per tree level for them
all instead of one per level for each. Measured on a 2-core AVX2 EPYC (SmolLM2
q3_k_m substitute, 8 chat requests, 8 requests' trees in one context against a
context each): 1-node trees 57 against 91 ms, 2-node 93 against 157, 2-node drawn
(T=0.7) 131 against 186, 8-node 365 against 547.

A request's trees and its order of minions are what they would be in a pass of its
own; only the time is shared. Each request is charged an equal share of a shared
grow (what its selector weighs a minion's time by), and every request's record also
holds the whole grow (StepRecord.minion_shared): the cost model fits it as passes
over all the requests' rows and prices such a minion once a tree level for the
batch (row_budget.BatchGrowCost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from minions_local.core.minion import BaseMinion
from minions_local.core.protocols import CandidateTree, GrowBudget
from minions_local.core.sampling import SamplingParams
from minions_local.speculation.budget import StepBudget, grow_shape, width_for
from minions_local.speculation.selection import MinionSelector
from minions_local.speculation.timing import timed
from minions_local.speculation.vote import source_shares


class BatchGrow(NamedTuple):
    """One grow_batch of several requests' trees, whole (StepRecord.minion_shared): what
    the cost model fits a shared pass's price to (cost_policy.grow_samples)."""

    requests: int
    nodes: int
    """Draft nodes allowed them all."""
    passes: int
    """The minion's passes per tree level, times the deepest tree's levels."""
    seconds: float

    @classmethod
    def of(cls, minion: BaseMinion, budgets: Sequence[GrowBudget], seconds: float) -> BatchGrow:
        levels = max((grow_shape(b.max_nodes, b.max_depth)[0] for b in budgets
                      if b.max_nodes > 0 and b.max_depth > 0), default=1)
        return cls(len(budgets), sum(b.max_nodes for b in budgets), levels * minion.passes_per_level(len(budgets)),
                   seconds)


@dataclass
class Growth:
    """What the minions did in one step; each list has one entry per minion, in the
    decoder's order."""

    proposals: list[CandidateTree | None]
    """Each minion's proposal; None: it did not grow this step."""
    seconds: list[float]
    """Each minion's grow time (0.0 when it did not grow; a share of a shared grow)."""
    allowed: list[int]
    """The draft nodes each minion was allowed (its share, when sampling)."""
    run_order: list[int] = field(default_factory=list)
    """The minions that grew, in the order they grew in."""
    batch_grows: dict[int, BatchGrow] = field(default_factory=dict)
    """Per minion that grew this request's tree together with other requests' (see
    StepRecord.minion_shared): the whole grow_batch."""

    @classmethod
    def empty(cls, minions: int) -> Growth:
        """No minion grew (none to ask, or a zero budget)."""
        return cls([None] * minions, [0.0] * minions, [0] * minions)

    @property
    def ran(self) -> list[bool]:
        return [p is not None for p in self.proposals]


@dataclass(eq=False)
class GrowJob:
    """One request's growing in a step: its context, slot and per-minion budgets."""

    context: list[int]
    slot: int
    selector: MinionSelector
    weights: list[float]
    """Each minion's vote weight this step."""
    budgets: list[GrowBudget]
    chosen: list[bool]
    sampled: bool
    growth: Growth
    _order: list[int] = field(default_factory=list)
    _expected: float = 0.0

    def next_minion(self) -> int | None:
        """The next minion in its selector's order that is chosen and still needed."""
        while self._order:
            m = self._order.pop(0)
            if self.chosen[m] and self.selector.still_needed(m, self._expected):
                return m
        return None

    def grew(self, m: int, proposal: CandidateTree, seconds: float, batch: BatchGrow | None = None) -> None:
        self.growth.proposals[m] = proposal
        self.growth.seconds[m] = seconds
        if batch is not None:
            self.growth.batch_grows[m] = batch
        self.growth.run_order.append(m)
        self._expected = max(self._expected, self.selector.expected(m, proposal))

    def benched(self) -> int | None:
        """Nobody proposed anything (the n-gram minion found no repeat, say) while a
        minion sits out: an empty tree spends a whole target pass on one token, so the
        cheapest benched minion grows after all. Measured on SmolLM2 with a q3_k_m
        substitute and n-gram (fixed 32 nodes, 4 chat prompts): 9 of 67 steps verified
        an empty tree without this. (Sampled steps keep their shares: a benched minion
        has none.)"""
        g = self.growth
        if self.sampled or not self.budgets or any(g.proposals[m] for m in g.run_order):
            return None
        return next((m for m in self.selector.order() if g.proposals[m] is None), None)


def new_job(context: list[int], slot: int, budget: StepBudget, selector: MinionSelector, weights: list[float],
            minions: Sequence[BaseMinion], *, draws: SamplingParams | None, generator: torch.Generator | None,
            top_k: int, vocab_limit: int) -> GrowJob:
    """A request's growing under `budget` (nothing to grow: no minion is asked).

    draws: the sampling settings the minions draw their drafts with (None: each
    proposes its most probable tokens)."""
    growth = Growth.empty(len(minions))
    if not minions or budget.nodes <= 0 or budget.depth <= 0:
        return GrowJob(context, slot, selector, weights, [], [False] * len(minions), draws is not None, growth)
    chosen = selector.choose()
    budgets = grow_budgets(budget, weights, chosen, minions, draws, generator, top_k, vocab_limit)
    growth.allowed = [b.max_nodes for b in budgets]
    return GrowJob(context, slot, selector, weights, budgets, chosen, draws is not None, growth,
                   selector.order())


def grow_budgets(budget: StepBudget, weights: list[float], chosen: list[bool], minions: Sequence[BaseMinion],
                 draws: SamplingParams | None, generator: torch.Generator | None, top_k: int,
                 vocab_limit: int) -> list[GrowBudget]:
    """Per minion: the step's tree shape (greedy), or its own share of the nodes with
    the sampling settings and the draft generator (sampled)."""
    if draws is None:
        tree_shape = GrowBudget(max_nodes=budget.nodes, max_depth=budget.depth, width=budget.width, top_k=top_k)
        budgets = [tree_shape] * len(minions)
    else:
        shares = source_shares(weights, chosen, budget.nodes, budget.depth, top_k)
        # The drafts' own stream, seeded from the request's so a seeded run repeats.
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        drafts = torch.Generator().manual_seed(seed)
        budgets = [GrowBudget(max_nodes=share, max_depth=budget.depth, width=width_for(share, budget.depth),
                              top_k=top_k, sampling=draws, generator=drafts, vocab_limit=vocab_limit)
                   for share in shares]
    # A minion that pays nothing per level (n-gram) follows a long repeat as far as
    # the step allows: the depth budget is there to bound the model minions' passes.
    return [replace(b, max_depth=budget.free_depth) if m.depth_is_free else b for b, m in zip(budgets, minions)]


def grow_all(minions: Sequence[BaseMinion], jobs: Sequence[GrowJob]) -> None:
    """Every job's proposals, in rounds (see the module's doc)."""
    while True:
        asked: dict[int, list[GrowJob]] = {}
        for job in jobs:
            m = job.next_minion()
            if m is not None:
                asked.setdefault(m, []).append(job)
        if not asked:
            break
        _grow_round(minions, asked)
    late: dict[int, list[GrowJob]] = {}
    for job in jobs:
        m = job.benched()
        if m is not None:
            late.setdefault(m, []).append(job)
    _grow_round(minions, late)


def _grow_round(minions: Sequence[BaseMinion], asked: dict[int, list[GrowJob]]) -> None:
    for m, jobs in asked.items():
        minion = minions[m]
        if minion.grows_batches and len(jobs) > 1:
            trees, seconds = timed(minion.grow_batch, [(job.slot, job.context, job.budgets[m]) for job in jobs])
            batch = BatchGrow.of(minion, [job.budgets[m] for job in jobs], seconds)
            for job, tree in zip(jobs, trees):
                job.grew(m, tree, seconds / len(jobs), batch)
            continue
        for job in jobs:
            minion.use_slot(job.slot)
            job.grew(m, *timed(minion.grow, job.context, job.budgets[m]))

