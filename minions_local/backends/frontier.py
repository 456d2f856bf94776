"""The best-first frontier every tree-growing minion shares.

A minion grows its candidate tree by repeatedly taking the best waiting candidates
(at most `budget.width` at a time, one forward pass's worth), running the ones that
may still get children, and offering those children back. What differs between
backends is only what a pass is (a tree-masked batch in transformers, one llama.cpp
sequence per node); the order in which candidates join the tree lives here.

A candidate's priority is its path log-probability, or, for sampled children
(`ranked`), the parent's priority plus the static score of each draw's rank
(core.protocols.rank_log_score): a sampled tree's shape must not depend on what was
drawn. Ties go to the candidate offered first.

A frontier outlives its step when a minion grows ahead (see Minion.grow_ahead):
`reroot` turns the subtree below the target's bonus token, waiting candidates
included, into the next step's head start.

When the target samples, both backends draw a node's children from their own
distribution (`drawn_children`) instead of proposing its top tokens.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable

import numpy as np
import torch

from minions_local.core.protocols import CandidateTree, GrowBudget, rank_log_score
from minions_local.core.sampling import processed_probs


class Frontier:
    """The candidates waiting to join `tree`, best first."""

    def __init__(self, tree: CandidateTree, budget: GrowBudget, *, ranked: bool = False) -> None:
        """ranked: children are offered in draw order and scored by their rank alone."""
        self.tree = tree
        self.budget = budget
        self.ranked = ranked
        self.depths: list[int] = []
        """Per tree node: its level below the root (1 = a child of the root)."""
        self._priorities: list[float] = []
        # (-priority, tie, parent, token, path logprob, depth)
        self._heap: list[tuple[float, int, int, int, float, int]] = []
        self._order = itertools.count()

    @property
    def tree_full(self) -> bool:
        return len(self.tree) >= self.budget.max_nodes

    def can_take(self) -> bool:
        """Whether a candidate waits and the tree has room for it."""
        return bool(self._heap) and not self.tree_full

    def may_expand(self, node: int) -> bool:
        """Whether `node`'s children would still be within the depth limit."""
        return self.depths[node] < self.budget.max_depth

    def worth_running(self, nodes: list[int]) -> list[int]:
        """The nodes among `nodes` whose children could still join the tree: within the
        depth limit, and not already outranked. A child's priority is at most its
        parent's (log-probabilities and rank scores are <= 0), and ties go to the
        candidate offered first, so once `room` waiting candidates rank at or above a
        node, none of its children can ever be taken: running it (a minion pass over
        it) is wasted. Skipping it leaves the tree exactly as it would have grown."""
        room = self.budget.max_nodes - len(self.tree)
        if room <= 0:
            return []
        nodes = [n for n in nodes if self.may_expand(n)]
        if len(self._heap) < room:
            return nodes
        bar = -heapq.nsmallest(room, self._heap)[-1][0]  # the room-th best waiting priority
        return [n for n in nodes if self._priorities[n] > bar]

    def offer(self, parent: int, children: Iterable[tuple[int, float]]) -> None:
        """Candidate children of `parent` (-1: the root) as (token, log-probability),
        best first (or in draw order when ranked). Offer only where may_expand holds."""
        depth = 1 if parent < 0 else self.depths[parent] + 1
        parent_lp = 0.0 if parent < 0 else self.tree.logprobs[parent]
        parent_priority = 0.0 if parent < 0 else self._priorities[parent]
        for rank, (token, lp) in enumerate(children, start=1):
            priority = parent_priority + (rank_log_score(rank) if self.ranked else lp)
            heapq.heappush(self._heap, (-priority, next(self._order), parent, token, parent_lp + lp, depth))

    def take(self) -> list[int]:
        """Move the best candidates (one pass's worth, as many as fit) into the tree;
        returns their node ids, a contiguous range."""
        batch: list[int] = []
        # The room is read once: re-read as the batch filled, it let a batch take at most
        # half the room left, so 32 nodes at width 8 took 8, 8, 8, 4, 2, 1, 1 (seven
        # passes, not the four that speculation/budget.grow_shape assumes), and a pass of
        # a memory-bound llama.cpp minion costs ~9 ms however few tokens it runs.
        size = min(self.budget.width, self.budget.max_nodes - len(self.tree))
        while self._heap and len(batch) < size:
            neg_priority, _, parent, token, lp, depth = heapq.heappop(self._heap)
            batch.append(self.tree.add(token, parent, lp))
            self._priorities.append(-neg_priority)
            self.depths.append(depth)
        return batch

    def reroot(self, node: int) -> tuple[Frontier, dict[int, int]]:
        """The frontier of the subtree below `node`, which becomes the root (-1): its
        nodes, their waiting candidates, and their priorities, path log-probabilities and
        depths counted from `node`, so it grows on exactly as a tree rooted there would.
        Returns it and the old id -> new id of every node kept (`node` -> -1)."""
        tree = self.tree
        inside = {node: -1}
        moved = CandidateTree()
        base_lp, base_priority, base_depth = tree.logprobs[node], self._priorities[node], self.depths[node]
        fresh = Frontier(moved, self.budget, ranked=self.ranked)
        for n in range(node + 1, len(tree)):  # parents come before their children
            if tree.parents[n] in inside:
                inside[n] = moved.add(tree.tokens[n], inside[tree.parents[n]], tree.logprobs[n] - base_lp)
                fresh._priorities.append(self._priorities[n] - base_priority)
                fresh.depths.append(self.depths[n] - base_depth)
        moved.draws = {inside[p]: d for p, d in tree.draws.items() if p in inside}
        fresh._heap = [(neg + base_priority, tie, inside[parent], token, lp - base_lp, depth - base_depth)
                       for neg, tie, parent, token, lp, depth in self._heap if parent in inside]
        heapq.heapify(fresh._heap)
        fresh._order = self._order  # ties keep their order of offer
        return fresh, inside


def drawn_children(logits: torch.Tensor, budget: GrowBudget, tree: CandidateTree,
                   parent: int) -> list[tuple[int, float]]:
    """Up to top_k tokens drawn without replacement from the minion's processed
    distribution q, in draw order, with their log q; records q as `parent`'s draws.

    Gumbel-top-k: sorting log q + Gumbel noise gives a draw-without-replacement order,
    so the i-th token follows q with the first i-1 removed and renormalized.
    """
    if budget.vocab_limit is not None:
        logits = logits[..., :budget.vocab_limit]
    q = processed_probs(logits, budget.sampling)
    tokens = draw_without_replacement(q, budget.top_k, budget.generator)
    tree.draws[parent] = q
    return list(zip(tokens, torch.log(q[tokens]).tolist()))


def draw_without_replacement(q: torch.Tensor, k: int, generator: torch.Generator | None) -> list[int]:
    """Up to k distinct tokens from q, in draw order (fewer when q has fewer tokens)."""
    # The request's generator is a CPU one (engine/reply.py): draw there, use on q's device.
    uniform = torch.rand(q.shape, generator=generator, dtype=torch.float64).clamp_(min=1e-300).to(q.device)
    keys = torch.log(q.double()) - torch.log(-torch.log(uniform))
    return torch.topk(keys, min(k, int((q > 0).sum()))).indices.tolist()


def top_children(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of [rows, vocab] logits (llama.cpp's, backends/gguf.py): the k best
    tokens (best first, ties by id) and their log-probabilities. One vectorised pass for
    a whole frontier, in torch: on a
    49k vocabulary its topk and logsumexp take 0.2 ms for a 2-row level where numpy's
    argpartition and exp took 1.1 (5.3 against 0.7 ms for 8 rows), and a grow runs one
    per level."""
    k = min(k, logits.shape[1])
    rows = torch.from_numpy(logits)
    values, top = torch.topk(rows, k, dim=1)
    logprobs = (values - torch.logsumexp(rows, dim=1, keepdim=True)).numpy()
    top = top.numpy()
    order = np.lexsort((top, -logprobs), axis=1)
    return np.take_along_axis(top, order, axis=1), np.take_along_axis(logprobs, order, axis=1)
