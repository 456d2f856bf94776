"""Row invariance, checked directly: what bf16 greedy identity rests on."""

from __future__ import annotations

from minions_local.backends.hf_target import path_rows_differing
from minions_local.core.tree import TokenTree


def assert_rows_are_one_token_passes(target, context: list[int], tree: TokenTree) -> None:
    """Every row of `target`'s pass over `tree` (below context[-1]) equals, bit for bit,
    the 1-token pass autoregressive decoding runs after the same tokens."""
    assert tree.tokens[0] == context[-1], "the tree's root is the context's last token"
    target.reset()
    rows = target.verify(context, tree)
    leaves = [n for n in range(len(tree)) if n not in tree.parents]  # their paths cover every node
    differing = {n for leaf in leaves for n in path_rows_differing(target, context, tree, rows, leaf)}
    assert not differing, f"tree rows {sorted(differing)} differ from their 1-token passes"
