"""Merging the minions' proposals into one voted tree (weights: selection.py).

A node's score estimates the probability that the target accepts the path to it:
the weighted average, over minions, of each minion's own path probability (0 for a
minion that did not propose the node). Because a path's probability never grows
as it gets longer, a child never outscores its parent, so best-first selection of
the top-N nodes always yields a connected subtree.
"""

from __future__ import annotations

import math

from ..backends.base import CandidateTree
from .tree import TokenTree


def merge_proposals(root_token: int, proposals: list[CandidateTree | None], weights: list[float],
                    vocab_limit: int | None = None) -> TokenTree:
    """One tree from every minion's proposal (None = the minion sat this step out).

    Tokens at or above `vocab_limit` (a minion with padded embeddings) are dropped
    with their subtrees: the target could not even embed them.
    """
    tree = TokenTree.from_root(root_token)
    total = sum(w for p, w in zip(proposals, weights) if p is not None) or 1.0
    for m, (proposal, weight) in enumerate(zip(proposals, weights)):
        if proposal is None:
            continue
        bit = 1 << m
        tree.proposers[0] |= bit
        share = weight / total
        mapped: list[int] = []
        for token, parent, logprob in zip(proposal.tokens, proposal.parents, proposal.logprobs):
            parent_node = 0 if parent < 0 else mapped[parent]
            if parent_node < 0 or (vocab_limit is not None and token >= vocab_limit):
                mapped.append(-1)
                continue
            node = tree.add(parent_node, token, 0.0, bit)
            tree.scores[node] += share * math.exp(logprob)
            mapped.append(node)
    return tree
