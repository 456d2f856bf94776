"""The two narrow interfaces the decode loop talks to, and what they exchange.

A *minion* proposes a candidate tree below the last committed token; a *target*
scores a packed tree in one pass and keeps the accepted path in its KV cache. HF,
GGUF and n-gram minions, resident and streamed targets, differ only behind these.

Token conventions shared by every backend: `context` is the full list of committed
token ids (prompt + generated). Its last token is the tree's *root*: it has not been
run through the model yet, so every backend caches at most `context[:-1]` between
steps and feeds the root together with the tree.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import torch

    from minions_local.core.sampling import SamplingParams
    from minions_local.core.tree import TokenTree


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
    sampling: SamplingParams | None = None
    """Set when the target samples: a minion that can sample draws its children from
    its own distribution under these same settings (see accept.py for why that helps
    and what it requires). None: propose deterministically (greedy decoding, or a
    minion that cannot sample)."""
    generator: torch.Generator | None = None
    """The draft randomness, derived from the request seed so seeded runs repeat."""
    vocab_limit: int | None = None
    """The target's vocabulary size: a sampling minion draws only below it, because a
    sampled token the target cannot embed could not be dropped without bias."""


@dataclass(slots=True)
class CandidateTree:
    """A minion's proposal. Node i has token tokens[i] and parent parents[i] (-1 = root).

    Parents always come before their children. `logprobs[i]` is the minion's
    cumulative log-probability of the path root -> i, used as its vote.

    `draws` marks sampled proposals: parent node (-1 = the root) -> the distribution
    its children were drawn from, without replacement, in node order (the first child
    is the first draw). Children of any other node are deterministic proposals.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    draws: dict[int, torch.Tensor] = field(default_factory=dict)

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


RANK_ACCEPT = 0.8
"""Static guess of how often a first-drawn sample is accepted; each later draw at the
same node is guessed half as likely as the one before."""


def rank_log_score(rank: int) -> float:
    """Log of the static score factor of a node's `rank`-th draw (1-based).

    Sampled trees are shaped by these scores alone, never by the drawn tokens or
    their probabilities: which draws are kept must not depend on their values, or the
    kept draws would no longer follow the distribution they were drawn from.
    """
    return math.log(RANK_ACCEPT) + (rank - 1) * math.log(0.5)


class AheadWindow:
    """How long a minion may grow ahead: until the target's verification ends (`done`
    is set), and no minion pass that would end after `deadline` (time.perf_counter
    seconds, the verification's predicted end) starts, since the decode loop would
    wait for it."""

    def __init__(self, deadline: float = math.inf) -> None:
        self.done = threading.Event()
        self.deadline = deadline

    def allows(self, seconds: float) -> bool:
        """Whether a pass of `seconds` may start now."""
        return not self.done.is_set() and time.perf_counter() + seconds <= self.deadline


@runtime_checkable
class Minion(Protocol):
    """A small model (or cheap heuristic) that proposes continuations: what a minion
    object must have. Every optional capability (serving several requests on slots of
    its own, growing ahead, growing or reading several requests in one pass) has a
    default in core/minion.py `BaseMinion`, which every minion in backends/ inherits
    and whose adapter gives a minion that does not (a user's own) the same defaults."""

    name: str
    vocab_size: int
    """Token ids it can propose (0: any id; the n-gram minion proposes ids it has seen)."""

    def prefill(self, context: list[int]) -> None:
        """Catch up on a new prompt before the first step, reusing what is cached, so
        that its per-step grow time (which decides whether it runs) is not charged for
        it. A minion with nothing to read ahead does nothing."""
        ...

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


@dataclass(slots=True)
class SlotTree:
    """One request's share of a shared verification pass."""

    slot: int
    """The request's slot (core/slots.py): its cache in the target."""
    context: list[int]
    tree: TokenTree


@dataclass(slots=True)
class PromptChunk:
    """A piece of a request's prompt read in a shared pass (prefill riding along with
    other requests' trees): `tokens` continue what the slot's cache holds."""

    slot: int
    tokens: list[int]


@runtime_checkable
class Target(Protocol):
    """The large model whose output is the output: it scores a whole voted tree in one
    pass and keeps the accepted path in its cache. Its cache holds every committed
    token but the last (the root), which runs with the tree."""

    vocab_size: int
    """Rows of its embedding: a draft token at or above it cannot be verified."""
    device: torch.device
    """Where its passes compute (on a CPU with a core to spare, the minions read a
    prompt on that core while the target does)."""

    def prefill(self, context: list[int]) -> None:
        """Bring the cache to context[:-1], reusing the longest cached prefix."""
        ...

    def verify(self, context: list[int], tree: TokenTree) -> torch.Tensor:
        """Logits [T, V] after each tree node (row 0: after the root, context[-1])."""
        ...

    def commit(self, tree: TokenTree, path: list[int]) -> None:
        """Keep the prefix and the accepted path (node ids, root first); drop the rest."""
        ...

    shares_passes: bool
    """Whether verify_batch runs several requests' trees in one pass (else one each)."""

    def verify_batch(self, trees: Sequence[SlotTree], chunks: Sequence[PromptChunk] = ()) -> list[torch.Tensor]:
        """Each request's tree verified on its own slot, as `verify` would alone, and
        each prompt chunk appended to its slot's cache in the same pass; the slot in
        use afterwards is unspecified (use_slot before commit)."""
        ...

    def missing_prompt(self, context: list[int]) -> list[int]:
        """The tokens of context[:-1] that the current slot's cache lacks (what a
        prefill would run), keeping the longest cached prefix."""
        ...

    def use_slot(self, slot: int) -> None:
        """Make `slot` (one request's cache; 0: the engine's conversation) the one that
        prefill/verify/commit act on; a new slot starts empty."""
        ...

    def drop_slot(self, slot: int) -> None:
        """Free a finished request's cache."""
        ...

    def reset(self) -> None:
        """Forget all cached state."""
        ...

    def forget_beyond(self, context: list[int]) -> None:
        """Keep no cache entry past context[:-1] (a reply has ended: the cache keeps
        only its prompt's entries)."""
        ...

    def bytes_streamed(self) -> int:
        """Cumulative weight bytes moved into compute memory so far (0 when resident)."""
        ...


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share: what a cache can keep."""
    n = min(len(a), len(b))
    if isinstance(a, list) and isinstance(b, list) and a[:n] == b[:n]:
        return n  # the usual case (a context that extends the cached one), compared in C
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

