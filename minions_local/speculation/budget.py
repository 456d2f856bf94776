"""How big a tree to verify each step.

A budget policy answers, before each step, how many draft nodes the target should
verify for each request and how deep the tree may go (`plan`); after the step it sees
the pass's record (`observe_pass`). The offload-aware cost model is one such policy
(cost_policy.py); the simple ones live here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

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


class TreeAsk(NamedTuple):
    """What a budget policy is told of one request before a step (`BudgetPolicy.plan`)."""

    remaining: int
    """Tokens it may still commit."""
    regime: str
    """How it decodes: one of REGIMES."""
    read_seconds: float = 0.0
    """What its minions would take to read what they have not read yet (a deferred
    prompt, tokens decoded without a tree): its next tree pays for that read."""


@dataclass(frozen=True)
class PassRecord:
    """One target pass, whole: the step record of every request whose tree rode it, and
    what the pass measured once. A budget policy learns from it once a pass
    (`BudgetPolicy.observe_pass`), whether one request or sixteen rode it."""

    steps: tuple[StepRecord, ...]
    """One per request, in the step's order."""
    t_verify: float
    """Seconds of the target's pass (each request's acceptance and commit included)."""
    rows: int
    """Rows the pass ran: every request's tree, roots included, and the prompt chunks'."""
    t_read: float = 0.0
    """Seconds the minions spent reading prompts before growing."""
    t_step: float | None = None
    """Wall seconds of the whole step: the policy, the reads, the growing and the pass
    (None: not measured)."""

    @classmethod
    def of(cls, step: StepRecord) -> PassRecord:
        """The pass of one request's step record (a pass it had to itself)."""
        return cls((step,), step.t_verify, step.pass_rows or step.tree_size + 1, step.t_read, step.t_step)

    @property
    def requests(self) -> int:
        return len(self.steps)

    @property
    def tokens(self) -> int:
        """Tokens the pass committed, all requests together."""
        return sum(s.new_tokens for s in self.steps)

    @property
    def tree_nodes(self) -> int:
        """Draft nodes the pass verified, all requests' trees together."""
        return sum(s.tree_size for s in self.steps)


REGIMES = ("greedy", "sampled", "seeded")
"""How a request decodes, which sets how much of a tree the target accepts:
greedy (temperature 0); sampled (the minions draw their drafts too); seeded (sampling
with a seed: the drafts stay the minions' top tokens, so the output cannot depend on
the tree and the seed reproduces it, at a lower acceptance)."""


class BudgetPolicy:
    """What the decoder asks a budget policy: `choose` and `observe` (one request's
    step) are its own; the rest have the defaults of a policy that prices nothing
    (FixedBudget, AdaptiveDepth): every request of a step as if the pass were its own. The cost
    model's policy overrides them (cost_policy.py)."""

    uses_timed_passes = False
    """Whether `calibrate` folds in the minions' and the target's timed passes: only
    then are they timed at load (calibration.calibrate_policy)."""

    def choose(self, remaining_tokens: int, regime: str = "greedy") -> StepBudget:
        """`regime`: one of REGIMES (acceptance differs between them)."""
        raise NotImplementedError

    def observe(self, record: StepRecord) -> None:
        """One request's step record, after the step."""

    def plan(self, asks: Sequence[TreeAsk | tuple]) -> list[StepBudget]:
        """Each request's budget in a step whose one target pass they share (one
        request or several; `TreeAsk`s, or tuples of their fields): each one's own
        `choose`, as if the pass were its own."""
        return [self.choose(remaining, regime=regime) for remaining, regime, *_ in asks]

    def observe_pass(self, record: PassRecord) -> None:
        """A pass's record, after the step: each request's step to `observe`."""
        for step in record.steps:
            self.observe(step)

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
