"""One request's tree in llama.cpp sequences, for the GGUF minion (backends/gguf.py
says how sequences make a tree mask, and how a tree is kept or carried).

Everything here touches only the request's own block of sequence ids, because other
requests may share the context: removing a sequence frees the cells no other
sequence holds, so dropping a branch never disturbs another request's cells.
"""

from __future__ import annotations

from collections.abc import Sequence

from minions_local.backends.frontier import Frontier
from minions_local.backends.llama_context import SeqBlock
from minions_local.core.protocols import CandidateTree, GrowBudget, common_prefix_len


class RequestTree:
    """A request's block of sequence ids, the committed prefix its first sequence holds,
    the last tree grown below the prefix and which of its nodes ran (each in a sequence
    of its own)."""

    def __init__(self, block: SeqBlock) -> None:
        self.block = block
        self.prefix: list[int] = []  # tokens held in the block's first sequence, at positions 0..len-1
        self.tree: CandidateTree | None = None  # the last grown tree below prefix[-1] ...
        self.frontier: Frontier | None = None  # ... the candidates waiting to join it ...
        self.node_seq: dict[int, int] = {}  # ... the sequence of each node that ran ...
        self.unrun: list[int] = []  # ... and its nodes that did not (outranked, or too deep)

    def _rm(self, seq: int) -> None:
        self.block.context.lib.llama_memory_seq_rm(self.block.context.mem, seq, -1, -1)

    def _cp(self, src: int, dst: int) -> None:
        self.block.context.lib.llama_memory_seq_cp(self.block.context.mem, src, dst, -1, -1)

    def reset(self) -> None:
        for seq in {self.block.first, *self.node_seq.values()}:  # every sequence holding a cell
            self._rm(seq)
        self.prefix = []
        self.forget_tree()

    def forget_tree(self) -> None:
        self.tree = self.frontier = None
        self.node_seq = {}
        self.unrun = []

    def prefill_plan(self, context: Sequence[int]) -> list[int]:
        """Keep the longest cached prefix of `context` in the first sequence and return
        the tokens still to run there (the root always runs)."""
        self.keep_tree_path(context)
        keep = min(common_prefix_len(self.prefix, context), len(context) - 1)
        if keep < len(self.prefix):
            llama = self.block.context
            llama.lib.llama_memory_seq_rm(llama.mem, self.block.first, keep, -1)
            del self.prefix[keep:]
        return [int(t) for t in context[keep:]]

    def keep_tree_path(self, context: Sequence[int]) -> None:
        """Fold the longest path of the last tree that `context` follows into the first
        sequence and drop every other tree cell."""
        tree = self.tree
        if tree is None:
            return
        node, i = -1, len(self.prefix)
        if common_prefix_len(self.prefix, context) == i:
            children: dict[tuple[int, int], int] = {}
            for n in self.node_seq:  # only nodes that ran have KV cells
                children[(tree.parents[n], tree.tokens[n])] = n
            while i < len(context) and (node, int(context[i])) in children:
                node = children[(node, int(context[i]))]
                i += 1
        kept = self.node_seq.get(node)
        for seq in self.node_seq.values():
            if seq != kept:
                self._rm(seq)
        if kept is not None:
            self._cp(kept, self.block.first)
            self._rm(kept)
            self.prefix.extend(int(t) for t in context[len(self.prefix):i])
        self.forget_tree()

    def carry(self, accepted: Sequence[int]) -> bool:
        """If the accepted tokens, bonus included, are a path of the last tree whose
        last node ran, make the subtree below it the tree of the next step."""
        tree, frontier = self.tree, self.frontier
        if tree is None or frontier is None or not accepted:
            return False
        children = {(tree.parents[n], tree.tokens[n]): n for n in range(len(tree))}
        node = -1
        for token in accepted:
            node = children.get((node, int(token)), -1)
            if node < 0:
                return False
        if node not in self.node_seq:
            return False
        frontier, inside = frontier.reroot(node)
        self._cp(self.node_seq[node], self.block.first)  # the accepted path joins the prefix
        for n, s in self.node_seq.items():
            if n not in inside or n == node:  # its descendants' cells keep their own sequences
                self._rm(s)
        self.prefix.extend(int(t) for t in accepted)
        self.frontier, self.tree = frontier, frontier.tree
        self.node_seq = {inside[n]: s for n, s in self.node_seq.items() if n in inside and n != node}
        self.unrun = [inside[n] for n in self.unrun if n in inside]
        return True

    def next_nodes(self, retry: list[int], cells: int, n_batch: int) -> tuple[list[int] | None, list[int]]:
        """The nodes of the next pass, each given a sequence that sees its path (empty
        when the nodes taken cannot run; None when the tree is done), and the nodes
        still to retry. `cells`: the KV cells this request may hold."""
        frontier = self.frontier
        used = set(self.node_seq.values())
        free = [s for s in reversed(self.block.tree_seqs) if s not in used]  # pop() takes the lowest
        # Each node that runs takes one KV cell and one sequence id.
        room = min(len(free), cells - len(self.prefix) - len(self.node_seq), n_batch)
        batch = retry[:min(frontier.budget.width, room)] if room > 0 else []
        if batch:
            retry = retry[len(batch):]
            self.unrun = [n for n in self.unrun if n not in batch]
        elif frontier.can_take():
            taken = frontier.take()  # out of cells or sequence ids, they still join, unrun
            batch = frontier.worth_running(taken)[:max(room, 0)]
            self.unrun.extend(n for n in taken if n not in batch)
        else:
            return None, retry
        for node in batch:
            self.node_seq[node] = free.pop()
            self._cp(self.node_seq.get(self.tree.parents[node], self.block.first), self.node_seq[node])
        return batch, retry

    def pass_rows(self, batch: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Tokens, positions and sequences of `batch`'s nodes in a pass."""
        root_pos = len(self.prefix) - 1
        return ([self.tree.tokens[n] for n in batch], [root_pos + self.frontier.depths[n] for n in batch],
                [self.node_seq[n] for n in batch])

    def proposal(self, budget: GrowBudget) -> CandidateTree:
        """A copy of the tree within `budget` (a carried tree may be larger or deeper):
        growing ahead adds to the tree while the caller still reads this one. Nodes
        joined best first, so any first n of them form a tree."""
        tree, depths, out = self.tree, self.frontier.depths, CandidateTree()
        new_id = {-1: -1}
        for n in range(len(tree)):
            if len(out) >= budget.max_nodes:
                break
            if depths[n] <= budget.max_depth and tree.parents[n] in new_id:
                new_id[n] = out.add(tree.tokens[n], new_id[tree.parents[n]], tree.logprobs[n])
        # The distributions drawn from, for the parents that kept a child (each is a vocab
        # of floats); kept children are a prefix of each parent's draws (best-first by rank).
        kept = set(out.parents)
        out.draws = {new_id[p]: q for p, q in tree.draws.items() if p in new_id and new_id[p] in kept}
        return out
