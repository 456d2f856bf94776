"""Merging the minions' proposals into one voted tree (weights: selection.py).

A node's score estimates the probability that the target accepts the path to it:
the weighted average, over minions, of each minion's own path probability (0 for a
minion that did not propose the node). Because a path's probability never grows
as it gets longer, a child never outscores its parent, so best-first selection of
the top-N nodes always yields a connected subtree (`merge_greedy`).

Sampled decoding merges differently (`merge_sampled`): every minion first gets its own node budget
(`source_shares`, from vote weights and static rank scores only), grows exactly
that, and the merged tree is verified whole. A global top-N after merging would let
one minion's drawn tokens decide which of another's draws survive, and a kept draw
must not depend on drawn values (accept.py). The merge also records each node's
draft entries: sampled ones in the minions' run order, then deterministic ones.
"""

from __future__ import annotations

import heapq
import math

from minions_local.core.protocols import CandidateTree, rank_log_score
from minions_local.core.tree import TokenTree


def merge_greedy(root_token: int, proposals: list[CandidateTree | None], weights: list[float],
                 vocab_limit: int | None = None) -> TokenTree:
    """One voted tree from every minion's proposal (None = the minion sat this step out).

    Tokens at or above `vocab_limit` (a minion with padded embeddings) are dropped
    with their subtrees: the target could not even embed them.
    """
    tree = TokenTree.from_root(root_token)
    shares = _vote_shares(proposals, weights)
    for m, proposal in enumerate(proposals):
        if proposal is not None:
            _add_votes(tree, m, proposal, shares[m], vocab_limit)
    return tree


def merge_sampled(root_token: int, proposals: list[CandidateTree | None], weights: list[float],
                  vocab_limit: int | None, run_order: list[int]) -> TokenTree:
    """The voted tree of a sampled step, with each node's draft entries recorded.

    `run_order` is the order the minions ran in: a minion whose running depended on
    earlier proposals only adds entries after theirs. Sampled entries go first, in
    that order; deterministic ones last, each token once per node.
    """
    tree = TokenTree.from_root(root_token)
    shares = _vote_shares(proposals, weights)
    deterministic: dict[int, list[int]] = {}
    for m in run_order:
        proposal = proposals[m]
        if proposal is None:
            continue
        mapped = _add_votes(tree, m, proposal, shares[m], vocab_limit)
        draft_of: dict[int, int] = {}  # this proposal's sampled parent -> index in tree.drafts
        for i, (token, parent) in enumerate(zip(proposal.tokens, proposal.parents)):
            parent_node = 0 if parent < 0 else mapped[parent]
            if parent_node < 0:
                continue  # below a dropped node: gone with its subtree
            if parent not in proposal.draws:
                if mapped[i] >= 0 and token not in deterministic.setdefault(parent_node, []):
                    deterministic[parent_node].append(token)
                continue
            if mapped[i] < 0:
                # A sampled draw dropped for its value would bias the draws after it.
                raise ValueError(f"minion {m} drew token {token}, past the target's vocabulary of {vocab_limit}: "
                                 "a sampling minion must draw below GrowBudget.vocab_limit")
            if parent not in draft_of:
                draft_of[parent] = len(tree.drafts)
                tree.drafts.append(proposal.draws[parent])
            tree.entries[parent_node].append((token, draft_of[parent]))
    # Deterministic entries go last: they may be chosen in view of the draws (any rule
    # is fine for them), and conditioning a draw on later entries is what must not happen.
    for node, tokens in deterministic.items():
        tree.entries[node].extend((token, -1) for token in tokens)
    return tree


def _vote_shares(proposals: list[CandidateTree | None], weights: list[float]) -> list[float]:
    """Each minion's weight as a share of the weights of the minions that proposed."""
    total = sum(w for p, w in zip(proposals, weights) if p is not None) or 1.0
    return [w / total for w in weights]


def _add_votes(tree: TokenTree, m: int, proposal: CandidateTree, share: float, vocab_limit: int | None) -> list[int]:
    """Add minion m's proposal to the tree, each node scoring `share` times its path
    probability; returns the tree node of each proposal node (-1: dropped)."""
    bit = 1 << m
    tree.proposers[0] |= bit
    mapped: list[int] = []
    for token, parent, logprob in zip(proposal.tokens, proposal.parents, proposal.logprobs):
        parent_node = 0 if parent < 0 else mapped[parent]
        if parent_node < 0 or (vocab_limit is not None and token >= vocab_limit):
            mapped.append(-1)
            continue
        node = tree.add(parent_node, token, 0.0, bit)
        tree.scores[node] += share * math.exp(logprob)
        mapped.append(node)
    return mapped


def source_shares(weights: list[float], running: list[bool], nodes: int, depth: int,
                  top_k: int) -> list[int]:
    """Sampled decoding: how many of the step's `nodes` each running minion grows.

    Every running minion gets one node (so its weight keeps learning); the rest go to
    the best static positions over all minions, a position scoring the minion's
    weight times the rank scores of its path (base.rank_log_score). Depends on
    weights and shapes only, never on what any minion will draw.
    """
    shares = [0] * len(weights)
    ids = [m for m, r in enumerate(running) if r]
    if not ids or nodes <= 0:
        return shares
    for m in ids[:nodes]:
        shares[m] = 1
    scores = static_position_scores(nodes, depth, top_k)
    candidates = [(-(math.log(max(weights[m], 1e-9)) + s), i, m)
                  for m in ids for i, s in enumerate(scores[1:], start=1)]
    for _, _, m in heapq.nsmallest(max(nodes - len(ids), 0), candidates):
        shares[m] += 1
    return shares


def static_position_scores(nodes: int, depth: int, top_k: int) -> list[float]:
    """Log scores of the first `nodes` positions of a sampled minion's best-first tree
    (the same order its grow() takes them in), best first."""
    frontier = [(-rank_log_score(r), 1) for r in range(1, top_k + 1)]
    heapq.heapify(frontier)
    out: list[float] = []
    while frontier and len(out) < nodes:
        neg, d = heapq.heappop(frontier)
        out.append(-neg)
        if d < depth:
            for r in range(1, top_k + 1):
                heapq.heappush(frontier, (neg - rank_log_score(r), d + 1))
    return out
