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

from dataclasses import dataclass, field

from .tree import TokenTree


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
    skipped: int = 0
    """Consecutive steps skipped."""
    backoff: int = 4


@dataclass
class MinionSelector:
    names: list[str]
    decay: float = 0.85
    floor: float = 0.05
    """Smallest vote weight relative to the best minion: a cold minion can recover."""
    adaptive: bool = True
    """False: every minion runs every step (weights still learn)."""
    stats: list[MinionStats] = field(default_factory=list)
    seconds_per_token: float | None = None

    def __post_init__(self) -> None:
        if not self.stats:
            self.stats = [MinionStats() for _ in self.names]

    def weights(self) -> list[float]:
        best = max((s.record for s in self.stats), default=1.0) or 1.0
        return [max(s.record / best, self.floor) for s in self.stats]

    def choose(self) -> list[bool]:
        """Which minions grow this step."""
        run = [self._worth_running(s) for s in self.stats]
        if self.stats and not any(run):
            # The cheapest re-check: retry whichever minion waited longest.
            run[max(range(len(self.stats)), key=lambda m: self.stats[m].skipped)] = True
        return run

    def _worth_running(self, s: MinionStats) -> bool:
        if not self.adaptive or s.cost is None or self.seconds_per_token is None:
            return True  # not measured yet: try it
        if s.marginal * self.seconds_per_token >= s.cost:
            return True
        return s.skipped + 1 >= s.backoff

    def observe(self, tree: TokenTree, path: list[int], ran: list[bool], grow_seconds: list[float],
                step_seconds: float, new_tokens: int) -> list[int]:
        """Learn from one verified step; returns each minion's accepted-token count."""
        counts = contributions(tree, path, len(self.stats))
        self.seconds_per_token = _ema(self.seconds_per_token, step_seconds / max(new_tokens, 1), self.decay)
        for m, s in enumerate(self.stats):
            if not ran[m]:
                s.skipped += 1
                continue
            if s.skipped:  # it was retried after a pause
                s.backoff = min(s.backoff * 2, 32) if self._worthless(s, tree, path, m) else 4
            s.skipped = 0
            s.record = _ema(s.record, counts[m], self.decay)
            s.marginal = _ema(s.marginal, marginal_tokens(tree, path, m), self.decay)
            s.cost = _ema(s.cost, grow_seconds[m], self.decay)
        return counts

    def _worthless(self, s: MinionStats, tree: TokenTree, path: list[int], m: int) -> bool:
        return marginal_tokens(tree, path, m) * (self.seconds_per_token or 0.0) < (s.cost or 0.0)


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
