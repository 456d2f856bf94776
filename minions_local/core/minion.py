"""What every minion can be asked, with the default a minion without the capability gets.

The decode step (speculation/) asks each minion the same questions and never looks
first: every minion in backends/ inherits `BaseMinion`, which answers each optional
capability for a minion that lacks it. A minion object of a user's own that does not
inherit it is wrapped at load time (`as_minion`), and the wrapper gives it the same
defaults, so one that only proposes trees still serves a batch of requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from minions_local.core.protocols import AheadWindow, CandidateTree, GrowBudget


class BaseMinion:
    """A minion (core/protocols.py `Minion`): `grow`, `commit` and `reset` are its own;
    every other member has a default here, the behaviour of a minion without it."""

    name: str
    vocab_size: int
    """Token ids it can propose (0: any id)."""
    depth_is_free = False
    """True for a minion whose grow time does not grow with depth (the n-gram minion):
    it then grows to the step's depth cap, not the depth the cost model chose."""
    grows_ahead = False
    """True for a minion that can go on growing its last tree while the target verifies
    it (`grow_ahead`), and start its next tree from what it grew."""
    grows_batches = False
    """True for a minion whose `grow_batch` grows several requests' trees in passes of
    its own (llama.cpp's, the compact forward's): a step's requests that ask it in the
    same round are grown in one call. Else each is grown by `grow` on its own slot,
    and timed on its own."""
    requests_per_pass = 1
    """Requests whose trees the cost model prices as sharing one of `grow_batch`'s
    passes (a pass per tree level for each group of that many; 1: each request's
    grow priced on its own, speculation/row_budget.py)."""

    def grow(self, context: list[int], budget: GrowBudget) -> CandidateTree:
        raise NotImplementedError

    def commit(self, accepted: list[int]) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def prefill(self, context: list[int]) -> None:
        """Nothing to read ahead: grow() reads what it has not seen."""

    def grow_ahead(self, budget: GrowBudget, window: AheadWindow) -> int:
        """Called on a second thread while the target verifies the last grow()'s tree
        (only where `grows_ahead`): keep growing that tree within `budget` while
        `window` allows, so that if the target's bonus token lands on a grown node, the
        next grow() starts from the subtree below it. Returns the nodes added (none,
        for a minion that cannot)."""
        return 0

    def use_slot(self, slot: int) -> None:
        """Make `slot`'s state (one request's caches, tables, grown tree; 0: the
        engine's conversation) the one that prefill/grow/commit/reset act on
        (core/slots.py). Without per-request state, nothing: grow() reuses its cache for
        the longest common prefix with whatever context it is given, so each switch
        between requests only costs it a re-read."""

    def drop_slot(self, slot: int) -> None:
        """Free a finished request's state (none to free without slots)."""

    def prefill_batch(self, requests: Sequence[tuple[int, Sequence[int]]]) -> None:
        """`prefill` for several requests, given as (slot, context): one after another."""
        for slot, context in requests:
            self.use_slot(slot)
            self.prefill(context)  # type: ignore[arg-type]

    def grow_batch(self, requests: Sequence[tuple[int, list[int], GrowBudget]]) -> list[CandidateTree]:
        """Several requests' trees, given as (slot, context, budget): one after another."""
        trees = []
        for slot, context, budget in requests:
            self.use_slot(slot)
            trees.append(self.grow(context, budget))
        return trees

    def passes_per_level(self, requests: int) -> int:
        """The passes one tree level of a `grow_batch` of `requests` requests takes: one
        for each group of `requests_per_pass` (what a shared grow is recorded as, and the
        cost model fits its price to: cost_policy.grow_samples)."""
        return -(-requests // max(1, self.requests_per_pass))

    def expect_requests(self, requests: int, tokens: int | None = None) -> None:
        """`requests` requests of at most `tokens` tokens each (None: not known) will
        decode together from now on (Decoder.expect_requests): a minion whose passes can
        hold several requests makes room for them. Nothing to arrange for one that
        cannot."""


class MinionAdapter(BaseMinion):
    """A minion object that does not inherit BaseMinion (a user's own): its own members
    where it has them, BaseMinion's defaults where it does not. Anything else (its
    `runner`, `weight_bytes`) is read from the object itself."""

    def __init__(self, minion: Any) -> None:
        self.__dict__["minion"] = minion

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["minion"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.minion, name, value)  # a rename (loading.unique_names) is the object's

    def _own(self, name: str) -> Any:
        return getattr(self.minion, name, None)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.minion.name

    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        return getattr(self.minion, "vocab_size", 0)

    @property
    def depth_is_free(self) -> bool:  # type: ignore[override]
        return getattr(self.minion, "depth_is_free", BaseMinion.depth_is_free)

    @property
    def grows_ahead(self) -> bool:  # type: ignore[override]
        return getattr(self.minion, "grows_ahead", BaseMinion.grows_ahead)

    @property
    def grows_batches(self) -> bool:  # type: ignore[override]
        # A grow_batch of its own is used, as it always was, whether or not it says so.
        return getattr(self.minion, "grows_batches", self._own("grow_batch") is not None)

    @property
    def requests_per_pass(self) -> int:  # type: ignore[override]
        return getattr(self.minion, "requests_per_pass", BaseMinion.requests_per_pass)

    def grow(self, context: list[int], budget: GrowBudget) -> CandidateTree:
        return self.minion.grow(context, budget)

    def commit(self, accepted: list[int]) -> None:
        self.minion.commit(accepted)

    def reset(self) -> None:
        self.minion.reset()

    def prefill(self, context: list[int]) -> None:
        if (own := self._own("prefill")) is not None:
            own(context)

    def grow_ahead(self, budget: GrowBudget, window: AheadWindow) -> int:
        own = self._own("grow_ahead")
        return own(budget, window) if own is not None else 0

    def use_slot(self, slot: int) -> None:
        if (own := self._own("use_slot")) is not None:
            own(slot)

    def drop_slot(self, slot: int) -> None:
        if (own := self._own("drop_slot")) is not None:
            own(slot)

    def prefill_batch(self, requests: Sequence[tuple[int, Sequence[int]]]) -> None:
        if (own := self._own("prefill_batch")) is not None:
            own(requests)
        else:
            super().prefill_batch(requests)

    def grow_batch(self, requests: Sequence[tuple[int, list[int], GrowBudget]]) -> list[CandidateTree]:
        own = self._own("grow_batch")
        return own(requests) if own is not None else super().grow_batch(requests)

    def passes_per_level(self, requests: int) -> int:
        if (own := self._own("passes_per_level")) is not None:
            return own(requests)
        # A grow_batch of its own that does not say how many requests a pass holds was
        # always taken to hold them all.
        return super().passes_per_level(requests) if self._own("requests_per_pass") is not None else 1

    def expect_requests(self, requests: int, tokens: int | None = None) -> None:
        if (own := self._own("expect_requests")) is not None:
            own(requests, tokens)


def as_minion(minion: Any) -> BaseMinion:
    """`minion` itself when it inherits BaseMinion, else wrapped to answer what it lacks."""
    return minion if isinstance(minion, BaseMinion) else MinionAdapter(minion)
