"""The voted token tree that the target verifies in one pass.

Node 0 is the *root*: the last committed token, which no model has run yet. Every
other node is a draft token; parents always come before their children, so a
prefix of the node list is itself a valid tree. The same tree is packed for the
target as one sequence with a tree attention mask and per-node positions.

For sampled decoding a node may also list its *draft entries*: the ordered
(token, draft) proposals the verifier walks (accept.py). `draft` indexes `drafts`,
the distribution the token was drawn from; -1 is a deterministic proposal. Two
entries may carry the same token (two minions drew it): both lead to one child.
A node without recorded entries offers its children as deterministic proposals.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class TokenTree:
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    scores: list[float] = field(default_factory=lambda: [1.0])
    proposers: list[int] = field(default_factory=lambda: [0])
    """Bitmask per node: bit m is set when minion m proposed the node."""
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])
    """Per node: token id -> child node index."""
    entries: list[list[tuple[int, int]]] = field(default_factory=lambda: [[]])
    """Per node: ordered draft entries (token, draft index or -1 = deterministic)."""
    drafts: list[torch.Tensor] = field(default_factory=list)
    """Distributions that sampled entries were drawn from (one per minion and parent)."""

    @classmethod
    def from_root(cls, root_token: int) -> TokenTree:
        return cls(tokens=[int(root_token)])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def draft_size(self) -> int:
        """Draft nodes: every node but the root."""
        return len(self.tokens) - 1

    @property
    def depth(self) -> int:
        return max(self.depths)

    def child(self, parent: int, token: int) -> int | None:
        return self.children[parent].get(token)

    def add(self, parent: int, token: int, score: float = 0.0, proposers: int = 0) -> int:
        """Add (or find) the child of `parent` with `token`; returns its index."""
        existing = self.children[parent].get(token)
        if existing is not None:
            self.proposers[existing] |= proposers
            return existing
        idx = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(float(score))
        self.proposers.append(proposers)
        self.children.append({})
        self.entries.append([])
        self.children[parent][int(token)] = idx
        return idx

    def has_drawn_entries(self, node: int) -> bool:
        """Whether any draft entry at `node` was drawn by a minion (not a fixed pick)."""
        return any(draft >= 0 for _, draft in self.entries[node])

    def draft_entries(self, node: int) -> list[tuple[int, int]]:
        """What the verifier walks at `node`, in order."""
        return self.entries[node] or [(token, -1) for token in self.children[node]]

    def select(self, max_nodes: int, max_depth: int) -> TokenTree:
        """The best connected subtree with at most `max_nodes` draft nodes.

        Best-first from the root by score, so a node is only taken after its parent;
        ties prefer shallower, then earlier nodes (stable across runs).
        """
        out = TokenTree.from_root(self.tokens[0])
        out.proposers[0] = self.proposers[0]
        heap: list[tuple[float, int, int, int]] = []

        def push_children(src: int, dst: int) -> None:
            for c in self.children[src].values():
                if self.depths[c] <= max_depth:
                    heapq.heappush(heap, (-self.scores[c], self.depths[c], c, dst))

        push_children(0, 0)
        while heap and out.draft_size < max_nodes:
            _, _, src, dst_parent = heapq.heappop(heap)
            dst = out.add(dst_parent, self.tokens[src], self.scores[src], self.proposers[src])
            push_children(src, dst)
        return out

    # --- packing for one forward pass -------------------------------------------------

    def ancestor_matrix(self) -> np.ndarray:
        """anc[i, j] is True when node j is node i or one of its ancestors."""
        n = len(self.tokens)
        anc = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                anc[i] = anc[p]
            anc[i, i] = True
        return anc

    def position_ids(self, prefix_len: int) -> torch.Tensor:
        """The root sits right after the cached prefix; each level one further."""
        return torch.tensor([prefix_len + d for d in self.depths], dtype=torch.long).unsqueeze(0)

    def attention_mask(self, prefix_len: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """Additive mask (1, 1, T, P+T): every node sees the prefix and its own ancestors.

        Additive float (0 / most negative) rather than boolean because transformers'
        eager attention adds the mask and silently misreads a boolean one.
        """
        return tree_attention_mask(self.ancestor_matrix(), prefix_len, dtype, device)


def tree_attention_mask(
    anc: np.ndarray, prefix_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Additive mask (1, 1, T, prefix_len + K) for T new tokens.

    The first `prefix_len` cached entries are visible to every new token; `anc` [T, K]
    says which of the last K entries (earlier tree nodes, then the T new tokens
    themselves) each new token may see.
    """
    t, k = anc.shape
    allowed = torch.ones((t, prefix_len + k), dtype=torch.bool)
    allowed[:, prefix_len:] = torch.from_numpy(np.ascontiguousarray(anc))
    mask = torch.zeros((t, prefix_len + k), dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.to(device).view(1, 1, t, prefix_len + k)

