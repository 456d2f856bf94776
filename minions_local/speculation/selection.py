"""Which minions run this step, and how much each one's vote counts (SPIN's point).

Minions differ: one is good at boilerplate, another at names, the n-gram minion at
text the conversation already contains. Each step we learn, per minion:

- its *vote weight*: an exponential average of how many accepted tokens lay on paths
  it proposed (so trusted minions steer the tree);
- its *marginal* tokens: how much shorter the accepted path would have been without
  it (what only it contributed);
- its *cost*: the seconds its grow() took.

A minion runs when what it adds is worth its time: marginal tokens x seconds per
token > its grow seconds. A skipped minion is retried after a back-off (4, 8, 16, 32
steps) so that a minion that becomes useful (a new kind of request) is noticed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from minions_local.core.protocols import CandidateTree
from minions_local.core.tree import TokenTree


def _ema(old: float | None, new: float, decay: float) -> float:
    return new if old is None else decay * old + (1 - decay) * new


@dataclass
class MinionStats:
    record: float = 1.0
    """EMA of accepted draft tokens on paths this minion proposed (its vote weight)."""
    marginal: float = 1.0
    """EMA of accepted draft tokens the path would have lost without this minion.
    Starts optimistic: one step where another minion covered the same path is no
    evidence that this one is redundant."""
    cost: float | None = None
    """EMA of this minion's grow() seconds."""
    calibration: float = 1.0
    """EMA of accepted tokens per token its own probabilities expected: how far to
    trust its proposals' self-estimate (an early-exit draft is confidently wrong)."""
    skipped: int = 0
    """Consecutive steps skipped."""
    deferred_yield: float | None = None
    """EMA of the accepted draft tokens of steps this minion sat out because the trees
    already grown looked good enough (`still_needed`): when that falls below what it
    delivers itself, the looks deceived, and it is no longer deferred."""
    backoff: int = 4


SELECTION_MODES = ("learned", "all", "equal")
"""learned: weights and skipping learn; all: every minion runs, weights learn;
equal: every minion runs with the same weight."""


@dataclass
class MinionSelector:
    names: list[str]
    decay: float = 0.85
    floor: float = 0.05
    """Smallest vote weight relative to the best minion: a cold minion can recover."""
    skips_minions: bool = True
    """Whether a minion not worth its time this step sits it out; False: every minion
    runs every step (weights still learn)."""
    learn_weights: bool = True
    """False: every minion's vote counts the same (the baseline learned weights must beat)."""
    stats: list[MinionStats] = field(default_factory=list)
    seconds_per_token: float | None = None
    _deferred: set[int] = field(default_factory=set, repr=False)

    @classmethod
    def for_mode(cls, names: list[str], mode: str) -> MinionSelector:
        if mode not in SELECTION_MODES:
            raise ValueError(f"minion selection must be one of {SELECTION_MODES}, got {mode!r}")
        return cls(names, skips_minions=mode == "learned", learn_weights=mode != "equal")

    def __post_init__(self) -> None:
        if not self.stats:
            self.stats = [MinionStats() for _ in self.names]

    def weights(self) -> list[float]:
        if not self.learn_weights:
            return [1.0] * len(self.stats)
        best = max((s.record for s in self.stats), default=1.0) or 1.0
        return [max(s.record / best, self.floor) for s in self.stats]

    def choose(self) -> list[bool]:
        """Which minions grow this step."""
        run = [self._worth_running(s) for s in self.stats]
        if self.stats and not any(run):
            # The cheapest re-check: retry whichever minion waited longest.
            run[max(range(len(self.stats)), key=lambda m: self.stats[m].skipped)] = True
        return run

    def order(self) -> list[int]:
        """Cheapest first (unmeasured first of all), so a costly minion can see what
        the cheap ones already proposed. Without skipping nobody looks, and
        the fixed order keeps sampled drafts (whose entry order follows this) from
        depending on timings."""
        if not self.skips_minions:
            return list(range(len(self.stats)))
        return sorted(range(len(self.stats)), key=lambda m: self.stats[m].cost or 0.0)

    def expected(self, m: int, proposal: CandidateTree) -> float:
        """Accepted tokens to expect from minion m's proposal: its own estimate, scaled
        by how well its estimates came true so far."""
        return minion_estimate(proposal) * self.stats[m].calibration

    def still_needed(self, m: int, expected_so_far: float) -> bool:
        """Per-context choice (SPIN): when the trees grown so far already expect more
        accepted tokens (calibrated, see `expected`) than minion m usually delivers (a
        long n-gram match, say), m's time is better saved this step. Such a step is not
        held against it."""
        s = self.stats[m]
        if not self.skips_minions or expected_so_far <= s.record:
            return True
        if s.deferred_yield is not None and s.deferred_yield < s.record:
            # Measured: a cheap, overconfident minion's big tree (a feature drafter at
            # ~50% agreement) deferred the substitute, and tokens per pass fell from
            # 5.0 to 3.0 (cpu-demo-disk, 3 chat requests).
            return True
        self._deferred.add(m)
        return False

    def _worth_running(self, s: MinionStats) -> bool:
        if not self.skips_minions or s.cost is None or self.seconds_per_token is None:
            return True  # not measured yet: try it
        if s.marginal * self.seconds_per_token >= s.cost:
            return True
        return s.skipped + 1 >= s.backoff

    def observe(self, tree: TokenTree, path: list[int], proposals: list[CandidateTree | None],
                grow_seconds: list[float], step_seconds: float, new_tokens: int) -> list[int]:
        """Learn from one verified step (None: that minion did not grow); returns each
        minion's accepted-token count."""
        counts = contributions(tree, path, len(self.stats))
        ran = [p is not None for p in proposals]
        self.seconds_per_token = _ema(self.seconds_per_token, step_seconds / max(new_tokens, 1), self.decay)
        deferred, self._deferred = self._deferred, set()
        for m, s in enumerate(self.stats):
            if m in deferred:
                s.deferred_yield = _ema(s.deferred_yield, len(path) - 1, self.decay)
            if not ran[m]:
                s.skipped += m not in deferred
                continue
            retried = s.skipped > 0
            s.skipped = 0
            s.record = _ema(s.record, counts[m], self.decay)
            s.marginal = _ema(s.marginal, marginal_tokens(tree, path, m), self.decay)
            s.cost = _ema(s.cost, grow_seconds[m], self.decay)
            estimate = minion_estimate(proposals[m])
            if estimate > 0:
                # Capped: one lucky step of a humble minion must not make it an oracle.
                s.calibration = _ema(s.calibration, min(counts[m] / estimate, 2.0), self.decay)
            if retried:  # it was retried after a pause: is it worth its time now?
                # Judged on the averages, not this one step: one lucky step of a slow
                # minion must not bring back a run of costly steps (measured: retries
                # of 5 ms minions took 18% of the RAM tier's step time).
                worthless = s.marginal * self.seconds_per_token < s.cost
                s.backoff = min(s.backoff * 2, 32) if worthless else 4
        return counts


def minion_estimate(proposal: CandidateTree) -> float:
    """The proposing minion's own estimate of the draft tokens the target will accept
    from this tree: each node is accepted exactly when its whole path is, so the sum of
    its path probabilities. (The cost model's `accepted_by_tree_size` is another thing:
    a prediction from calibrated rates, made before anything is grown.)"""
    return sum(math.exp(lp) for lp in proposal.logprobs)


def contributions(tree: TokenTree, accepted_path: list[int], n_minions: int) -> list[int]:
    """Per minion: accepted draft nodes (root excluded) that the minion proposed."""
    counts = [0] * n_minions
    for node in accepted_path[1:]:
        mask = tree.proposers[node]
        for m in range(n_minions):
            if mask >> m & 1:
                counts[m] += 1
    return counts


def marginal_tokens(tree: TokenTree, accepted_path: list[int], minion: int) -> int:
    """Accepted draft nodes lost if `minion` had not proposed anything: the path
    stops at the first node nobody else proposed."""
    others = ~(1 << minion)
    for depth, node in enumerate(accepted_path[1:]):
        if not tree.proposers[node] & others:
            return len(accepted_path) - 1 - depth
    return 0
