"""Row invariance, checked directly: what bf16 greedy identity rests on."""

from __future__ import annotations

import torch

from minions_local.core.tree import TokenTree


def assert_rows_are_one_token_passes(target, context: list[int], tree: TokenTree) -> None:
    """Every row of `target`'s pass over `tree` (below context[-1]) equals, bit for bit,
    the 1-token pass autoregressive decoding runs after the same tokens."""
    assert tree.tokens[0] == context[-1], "the tree's root is the context's last token"
    target.reset()
    rows = target.verify(context, tree)
    for node in range(len(tree)):
        path = [node]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        tokens = [tree.tokens[n] for n in reversed(path[:-1])]  # below the root
        target.reset()
        ids = list(context)
        for token in [None] + tokens:
            ids = ids if token is None else ids + [token]
            step = TokenTree.from_root(ids[-1])
            one = target.verify(ids, step)[0]
            target.commit(step, [0])
        assert torch.equal(one, rows[node]), f"tree row {node} differs from its 1-token pass"
    target.reset()
