"""How big a tree to verify each step.

A budget policy answers, before each step, how many draft nodes the target should
verify and how deep the tree may go; after the step it sees what happened. The
offload-aware cost model is one such policy (cost.py); the simple ones live here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from minions_local.core.events import StepRecord


@dataclass(frozen=True, slots=True)
class StepBudget:
    nodes: int
    """Draft nodes the target verifies at most."""
    depth: int
    """Tree levels below the root at most."""
    width: int
    """Nodes each minion adds per forward pass while growing."""
    depth_cap: int = 0
    """How deep a minion whose depth is free (n-gram) may grow; 0: `depth`."""
    predicted_t_verify: float | None = None
    predicted_t_grow: float | None = None
    """Expected grow time, each minion weighted by how often it has been running."""
    grow_overhead: float = 0.0
    """Predicted seconds of voting and bookkeeping, whoever grows."""
    grow_models: tuple = ()
    """Per minion, its grow-time model: `.name`, and `(nodes, depth, width) -> seconds`."""

    @property
    def free_depth(self) -> int:
        """How deep a minion whose depth is free grows, and how deep the vote keeps nodes."""
        return max(self.depth, self.depth_cap)

    def predicted_grow_for(self, nodes_by_minion: Mapping[str, int]) -> float | None:
        """The grow time predicted for the minions that did run, each with the nodes
        it was given (the selector decides who runs during the step; when sampling,
        each minion grows its share). The step record compares this with the clock."""
        if not self.grow_models:
            return self.predicted_t_grow
        total = self.grow_overhead
        for g in self.grow_models:
            nodes = nodes_by_minion.get(g.name, 0)
            if nodes > 0 and self.depth > 0:
                total += g(nodes, *grow_shape(nodes, self.depth))
        return total


REGIMES = ("greedy", "sampled", "seeded")
"""How a request decodes, which sets how much of a tree the target accepts:
greedy (temperature 0); sampled (the minions draw their drafts too); seeded (sampling
with a seed: the drafts stay the minions' top tokens, so the output cannot depend on
the tree and the seed reproduces it, at a lower acceptance)."""


class BudgetPolicy:
    """What the decoder asks a budget policy: `choose` and `observe` are its own; the
    rest have the defaults of a policy that prices nothing (FixedBudget, AdaptiveDepth),
    which the cost model's policy overrides (cost_policy.py)."""

    uses_timed_passes = False
    """Whether `calibrate` folds in the minions' and the target's timed passes: only
    then are they timed at load (calibration.calibrate_policy)."""

    def choose(self, remaining_tokens: int, regime: str = "greedy") -> StepBudget:
        """`regime`: one of REGIMES (acceptance differs between them)."""
        raise NotImplementedError

    def observe(self, record: StepRecord) -> None:
        """A step's record, after the step."""

    def choose_shared(self, requests: Sequence[tuple[int, str, float]]) -> list[StepBudget]:
        """Budgets for requests that share one target pass, each given as (remaining
        tokens, regime, seconds its minions would take to read what they have not read
        yet): each request's own choice, as if alone."""
        return [self.choose(remaining, regime=regime) for remaining, regime, *_ in requests]

    def price_batch_grows(self, groups: dict[str, int]) -> None:
        """Per minion that grows a batch's trees in its own passes, the requests the
        cost model may price one pass to hold (Decoder.expect_requests): nothing to
        price here."""

    def calibrate(self, grow_samples: dict[str, list[tuple[int, float]]],
                  verify_samples: Sequence[tuple[int, float]] = ()) -> None:
        """Timed passes (calibration.py), for a policy that `uses_timed_passes`."""


def width_for(nodes: int, depth: int) -> int:
    # Spread the nodes over the levels: a budget of 32 at depth 8 grows 4 per pass.
    return max(1, -(-nodes // max(depth, 1)))


def grow_shape(nodes: int, depth: int) -> tuple[int, int]:
    """(passes, nodes per pass) of a minion growing `nodes` nodes at most `depth` deep:
    one pass per level, never more levels than nodes."""
    passes = max(1, min(depth, nodes))
    return passes, width_for(nodes, passes)


@dataclass
class FixedBudget(BudgetPolicy):
    """The same tree size every step (also what `minions=[]` uses with nodes=0)."""

    nodes: int = 32
    depth: int = 8

    def choose(self, remaining_tokens: int, regime: str = "greedy") -> StepBudget:
        depth = max(0, min(self.depth, remaining_tokens - 1))
        nodes = self.nodes if depth else 0
        return StepBudget(nodes=nodes, depth=depth, width=width_for(nodes, depth))


@dataclass
class AdaptiveDepth(BudgetPolicy):
    """Depth follows the accepted length (HF assisted generation's +2/-1 rule, for trees).

    When the whole depth was accepted, go deeper; otherwise back off by one. The node
    budget stays fixed: on a bf16 CPU or a streamed GPU target, verifying more nodes
    costs little until compute catches up with the weight traffic.
    """

    nodes: int = 32
    depth: int = 6
    min_depth: int = 2
    max_depth: int = 16

    def choose(self, remaining_tokens: int, regime: str = "greedy") -> StepBudget:
        depth = max(0, min(self.depth, remaining_tokens - 1))
        nodes = max(self.nodes, depth) if depth else 0
        return StepBudget(nodes=nodes, depth=depth, width=width_for(nodes, depth))

    def observe(self, record: StepRecord) -> None:
        if record.depth == 0:
            return
        if record.accepted >= record.depth:
            self.depth = min(self.depth + 2, self.max_depth)
        else:
            self.depth = max(self.depth - 1, self.min_depth, record.accepted + 1)
