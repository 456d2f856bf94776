"""The target: scores a whole voted tree in one forward pass.

Its cache holds every committed token but the last (the root). `verify` runs the
root and the draft nodes together; `commit` keeps the prefix plus the accepted
path's entries and drops the rejected branches. Whether the layers are resident or
streamed from RAM or disk is a property of the model object it wraps.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..speculation.tree import TokenTree
from .hf import CachedModel


class HFTarget(CachedModel):
    def __init__(self, model, bytes_streamed: Callable[[], int] | None = None) -> None:
        super().__init__(model)
        self._bytes_streamed = bytes_streamed or (lambda: 0)
        self._prefix_len = 0

    def bytes_streamed(self) -> int:
        """Cumulative weight bytes moved into compute memory so far."""
        return self._bytes_streamed()

    def prefill(self, context: list[int]) -> None:
        """Bring the cache to context[:-1], reusing the longest cached prefix."""
        self.extend(self.sync(context[:-1]))

    def verify(self, context: list[int], tree: TokenTree) -> torch.Tensor:
        """Logits [T, V] after each tree node (row 0: after the root)."""
        self.prefill(context)
        self._prefix_len = self.cache_len
        return self.forward(tree.tokens, tree.ancestor_matrix(), tree.depths, self._prefix_len)

    def commit(self, tree: TokenTree, path: list[int]) -> None:
        """Keep the prefix and the accepted path (root first) in the cache."""
        p = self._prefix_len
        if path == list(range(len(path))):
            self.truncate(p + len(path))  # a prefix of the packing order (always so for a chain)
        else:
            self.keep_entries(list(range(p)) + [p + i for i in path])
        self.cached.extend(tree.tokens[i] for i in path)
