"""The n-gram minion: prompt lookup over the conversation (and optionally a corpus).

Chat and code repeat themselves: names, quoted lines, code being edited. This minion
finds earlier places where the last few committed tokens occurred before and proposes
what followed them there, merged into a tree that branches where those continuations
disagree. It runs no model, so it costs microseconds and can propose deep trees.

Scores: every earlier occurrence votes for its continuation with a weight equal to
the length of the suffix it matched, growing by one per token down the path (once the
first proposed token is accepted, the match is one token longer). At each tree node a
child's probability is its share of its siblings' weight plus a fixed "something
else" mass of 2.5. On Python sources a single n-token match is followed by the same
next token with probability ~n / (n + 2.5) (measured: 0.23 for n=1, 0.53 for 3, 0.80
for 8), so one occurrence scores exactly that, and agreement between occurrences
raises it. Measured on held-out files, path probabilities predicted 0.25 / 0.55 /
0.84 came true 0.22 / 0.65 / 0.96 of the time: close enough to vote with model
log-probabilities. `logprobs` are the log of the product along the path.

Token ids are taken from the context itself, so the minion fits any vocabulary
(`vocab_size == 0` means "any").
"""

from __future__ import annotations

import heapq
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minions_local.core.errors import ModelLoadError
from minions_local.core.minion import BaseMinion
from minions_local.core.protocols import CandidateTree, GrowBudget, common_prefix_len
from minions_local.core.slots import SlotStates

_SPEC_KEYS: dict[str, Callable[[str], Any]] = {
    "name": str, "max_match": int, "min_match": int, "max_occurrences": int, "unknown_mass": float,
    "recency": float, "corpus_weight": float, "corpus": str,
}


class ContextIndex:
    """End positions of every n-gram (n <= max_n) of a token sequence, kept in step with
    a changing context: appending is O(max_n) per token, and a rollback pops exactly the
    entries the dropped tokens added."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def sync(self, context: Sequence[int]) -> None:
        keep = common_prefix_len(self.tokens, context)
        while len(self.tokens) > keep:
            end = len(self.tokens) - 1
            for n in range(1, min(self.max_n, end + 1) + 1):
                key = tuple(self.tokens[end - n + 1:end + 1])
                ends = self._ends[key]
                ends.pop()  # positions are appended in order, so `end` is the last one
                if not ends:
                    del self._ends[key]
            self.tokens.pop()
        for token in context[keep:]:
            self.tokens.append(int(token))
            end = len(self.tokens) - 1
            for n in range(1, min(self.max_n, end + 1) + 1):
                self._ends.setdefault(tuple(self.tokens[end - n + 1:end + 1]), []).append(end)

    def continuations(self, suffix: Sequence[int], limit: int, length: int) -> list[tuple[int, list[int]]]:
        """(end position, up to `length` following tokens) for the `limit` most recent
        earlier occurrences of `suffix` that have a continuation."""
        ends = self._ends.get(tuple(suffix), [])
        last = len(self.tokens) - 1
        out = []
        for end in reversed(ends):
            if end >= last:
                continue  # the suffix itself: nothing follows it yet
            out.append((end, self.tokens[end + 1:end + 1 + length]))
            if len(out) >= limit:
                break
        return out


class CorpusIndex:
    """Occurrences of short token patterns in a fixed corpus: the corpus positions sorted
    by their next `max_n` tokens, searched by bisection (no per-n-gram dictionary, so a
    corpus of millions of tokens stays a few arrays)."""

    def __init__(self, tokens: Sequence[int], max_n: int) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.max_n = max_n
        n = len(self.tokens)
        # windows[i, j] = tokens[i + j], or -1 past the end (sorts before every token)
        padded = np.concatenate([self.tokens, np.full(max_n, -1, dtype=np.int64)])
        self._windows = np.lib.stride_tricks.sliding_window_view(padded, max_n)[:n]
        self._order = np.lexsort(self._windows.T[::-1]) if n else np.zeros(0, dtype=np.int64)

    def continuations(self, suffix: Sequence[int], limit: int, length: int) -> list[tuple[int, list[int]]]:
        pattern = tuple(int(t) for t in suffix)
        if not len(self.tokens) or len(pattern) > self.max_n:
            return []
        lo = self._bisect(pattern, strict=False)
        hi = self._bisect(pattern, strict=True)
        starts = np.sort(self._order[lo:hi])[::-1]  # latest first, like the context index
        out = []
        for start in starts:
            end = int(start) + len(pattern) - 1
            if end + 1 < len(self.tokens):
                out.append((end, self.tokens[end + 1:end + 1 + length].tolist()))
                if len(out) >= limit:
                    break
        return out

    def _bisect(self, pattern: tuple[int, ...], strict: bool) -> int:
        """First sorted position whose window prefix is >= pattern (> pattern if strict)."""
        lo, hi, n = 0, len(self._order), len(pattern)
        while lo < hi:
            mid = (lo + hi) // 2
            prefix = tuple(self._windows[self._order[mid], :n].tolist())
            if prefix < pattern or (strict and prefix == pattern):
                lo = mid + 1
            else:
                hi = mid
        return lo


@dataclass(slots=True)
class _TrieNode:
    weight: float = 0.0
    children: dict[int, "_TrieNode"] = field(default_factory=dict)


class NGramMinion(SlotStates, BaseMinion):
    """Prompt-lookup minion; each request (slot) indexes its own context, the corpus
    is shared. Keyword arguments:

    max_match / min_match: suffix lengths tried, longest first.
    max_occurrences: earlier occurrences used per suffix length (most recent first).
    unknown_mass: weight of "something else" at every node; larger = more cautious scores
        (2.5 calibrates a lone n-token match to its measured hit rate n / (n + 2.5)).
    recency: weight factor per step back among the occurrences of one suffix length.
    corpus: token ids of a local corpus searched after the conversation.
    corpus_weight: multiplier for votes from the corpus (the conversation is more telling).
    """

    SLOT_FIELDS = ("_context",)

    def __init__(self, *, name: str = "ngram", max_match: int = 8, min_match: int = 1, max_occurrences: int = 8,
                 unknown_mass: float = 2.5, recency: float = 0.9, corpus: Sequence[int] | None = None,
                 corpus_weight: float = 0.5) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError("need 1 <= min_match <= max_match")
        self.name = name
        self.vocab_size = 0  # any: proposals are ids seen in the context or corpus
        self.depth_is_free = True
        """Its proposals cost nothing per level: it may grow deeper than the model minions."""
        self.grows_ahead = False  # a grow takes microseconds: nothing to hide
        self.max_match = max_match
        self.min_match = min_match
        self.max_occurrences = max_occurrences
        self.unknown_mass = unknown_mass
        self.recency = recency
        self.corpus_weight = corpus_weight
        self._context = ContextIndex(max_match)  # the slot in use's (core/slots.py)
        self._corpus = CorpusIndex(corpus, max_match) if corpus is not None and len(corpus) else None

    @classmethod
    def from_text_file(cls, path: str | os.PathLike[str], encode: Callable[[str], list[int]],
                       **kwargs) -> "NGramMinion":
        """An n-gram minion that also searches a local text file, tokenized with `encode`
        (for example `lambda s: tokenizer.encode(s, add_special_tokens=False)`)."""
        text = Path(path).expanduser().read_text(encoding="utf-8", errors="replace")
        return cls(corpus=encode(text), **kwargs)

    @classmethod
    def from_spec(cls, spec: str = "ngram", encode: Callable[[str], list[int]] | None = None) -> "NGramMinion":
        """From a minions=[...] / CLI string: "ngram", or "ngram:key=value,..." with keys
        max_match, min_match, max_occurrences, unknown_mass, recency, corpus_weight, name
        and corpus=PATH (a text file; needs `encode`, the target tokenizer's encode)."""
        head, _, tail = spec.partition(":")
        if head != "ngram":
            raise ValueError(f"not an n-gram minion spec: {spec!r}")
        kwargs: dict[str, Any] = {}
        corpus_path = None
        for item in filter(None, tail.split(",")):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or key not in _SPEC_KEYS:
                raise ValueError(f"bad n-gram option {item!r} in {spec!r}; known: {', '.join(sorted(_SPEC_KEYS))}")
            if key == "corpus":
                corpus_path = value
            else:
                kwargs[key] = _SPEC_KEYS[key](value)
        if corpus_path is None:
            return cls(**kwargs)
        if encode is None:
            raise ModelLoadError(f"{spec!r}: a corpus file needs the target's tokenizer to read it.")
        if not Path(corpus_path).expanduser().is_file():
            raise ModelLoadError(f"n-gram corpus {corpus_path} does not exist: check the path in {spec!r}.")
        return cls.from_text_file(corpus_path, encode, **kwargs)

    def grow(self, context: list[int], budget: GrowBudget) -> CandidateTree:
        tree = CandidateTree()
        if budget.max_nodes <= 0 or budget.max_depth <= 0 or not context:
            return tree
        self._context.sync(context)
        trie = self._vote(context, budget.max_depth)
        return self._best_first(trie, budget, tree)

    def commit(self, accepted: list[int]) -> None:
        # The index follows the context given to grow(): nothing to do until then.
        pass

    def reset(self) -> None:
        self._context = ContextIndex(self.max_match)

    def fresh_slot_state(self) -> dict[str, Any]:
        return super().fresh_slot_state() | {"_context": ContextIndex(self.max_match)}

    def _vote(self, context: list[int], depth: int) -> _TrieNode:
        """A trie of the continuations of earlier occurrences, each weighted by the
        length of the suffix it matched (an occurrence counts once, at its longest)."""
        root = _TrieNode()
        sources = [(self._context, 1.0)]
        if self._corpus is not None:
            sources.append((self._corpus, self.corpus_weight))
        for index, scale in sources:
            seen: set[int] = set()
            for n in range(min(self.max_match, len(context)), self.min_match - 1, -1):
                found = index.continuations(context[-n:], self.max_occurrences, depth)
                for rank, (end, continuation) in enumerate(found):
                    if end in seen:
                        continue
                    seen.add(end)
                    # Recent occurrences count a little more: topics drift.
                    _insert(root, continuation, n, scale * self.recency**rank)
        return root

    def _best_first(self, trie: _TrieNode, budget: GrowBudget, tree: CandidateTree) -> CandidateTree:
        order = itertools.count()  # ties: shallower / earlier first, so parents precede children
        frontier: list[tuple[float, int, int, int, float, int, _TrieNode]] = []

        def offer(node: _TrieNode, index: int, node_lp: float, depth: int) -> None:
            if depth > budget.max_depth or not node.children:
                return
            total = sum(child.weight for child in node.children.values()) + self.unknown_mass
            best = sorted(node.children.items(), key=lambda kv: -kv[1].weight)[:budget.top_k]
            for token, child in best:
                lp = node_lp + float(np.log(child.weight / total))
                heapq.heappush(frontier, (-lp, depth, next(order), token, lp, index, child))

        offer(trie, -1, 0.0, 1)
        while frontier and len(tree) < budget.max_nodes:
            _, depth, _, token, lp, parent, node = heapq.heappop(frontier)
            offer(node, tree.add(token, parent, lp), lp, depth + 1)
        return tree


def _insert(root: _TrieNode, continuation: Sequence[int], matched: int, scale: float) -> None:
    """Vote for a continuation. Its d-th token follows a match of `matched + d - 1`
    tokens once the earlier ones are accepted, so deeper tokens vote with more weight."""
    node = root
    for depth, token in enumerate(continuation, start=1):
        node = node.children.setdefault(int(token), _TrieNode())
        node.weight += scale * (matched + depth - 1)

