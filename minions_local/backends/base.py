"""The two narrow interfaces the decode loop talks to.

A *minion* proposes a candidate tree below the last committed token; a *target*
scores a packed tree in one pass and keeps the accepted path in its KV cache. HF,
GGUF and n-gram minions, resident and streamed targets, differ only behind these.

Token conventions shared by every backend: `context` is the full list of committed
token ids (prompt + generated). Its last token is the tree's *root*: it has not been
run through the model yet, so every backend caches at most `context[:-1]` between
steps and feeds the root together with the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable


@dataclass(slots=True)
class GrowBudget:
    """How large a tree one minion may grow this step."""

    max_nodes: int
    """Draft nodes at most (the root is not counted)."""
    max_depth: int
    """Levels below the root at most (1 = only children of the root)."""
    width: int = 8
    """Nodes added per forward pass: 1 grows a chain; more grows a bushier tree."""
    top_k: int = 8
    """Children considered per expanded node."""


@dataclass(slots=True)
class CandidateTree:
    """A minion's proposal. Node i has token tokens[i] and parent parents[i] (-1 = root).

    Parents always come before their children. `logprobs[i]` is the minion's
    cumulative log-probability of the path root -> i, used as its vote.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, logprob: float) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.logprobs.append(float(logprob))
        return len(self.tokens) - 1

    def depth(self) -> int:
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return max(depths, default=0)


@runtime_checkable
class Minion(Protocol):
    """A small model (or cheap heuristic) that proposes continuations."""

    name: str
    vocab_size: int

    def grow(self, context: list[int], budget: GrowBudget) -> CandidateTree:
        """Propose a tree below context[-1]. Reuses its cache for the longest common
        prefix with what it saw before, so any context (a new chat turn, a rollback)
        is valid."""
        ...

    def commit(self, accepted: list[int]) -> None:
        """The target accepted `accepted` (draft path tokens + the bonus token) after
        the last grow(). Keep what is reusable from the tree, drop the rest."""
        ...

    def reset(self) -> None:
        """Forget all cached state."""
        ...


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share: what a cache can keep."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prefill(minion: Minion, context: list[int]) -> None:
    """Let a minion catch up on a new prompt before the first step, if it can, so
    that its per-step grow time (which decides whether it runs) is not charged for it."""
    catch_up = getattr(minion, "prefill", None)
    if catch_up is not None:
        catch_up(context)
