"""A Hugging Face minion: grows its candidate tree best-first by path probability.

Each forward pass expands the `width` most probable frontier nodes at once (a
tree-masked batch), so a tree of depth D costs about D small passes; width 1 is a
plain draft chain. Nodes added in the last round are never run: their scores come
from their parents' distributions, and nobody will expand them this step.

When the target samples (budget.sampling is set), each expanded node's children are
instead *drawn* without replacement from the minion's distribution under the same
temperature/top-k/top-p, and the tree grows best-first on a static score of the draw
ranks (core.protocols.rank_log_score): its shape never depends on what was drawn, which is
what lets the verifier accept a draw with probability min(1, p/q) (accept.py).
"""

from __future__ import annotations

import numpy as np
import torch

from minions_local.core.protocols import AheadWindow, CandidateTree, GrowBudget
from minions_local.backends.compact import CompactModel, supports
from minions_local.backends.frontier import Frontier, drawn_children
from minions_local.backends.hf import CachedModel


class CompactMinion(CompactModel):
    exact = False  # a minion's rounding need not match anyone's: the target decides


class HFMinion:
    depth_is_free = False  # a deeper tree takes more forward passes
    grows_ahead = False  # its passes would compete with the target's for torch's threads

    def __init__(self, model, name: str, compact: bool = True, release_weights: bool = False) -> None:
        """release_weights: with the compact forward, drop the transformers modules'
        copies of the fused weights (the loader owns the model, so it may)."""
        # The compact forward is the same math with a fraction of the framework
        # overhead, which is most of a small model's time; transformers runs the rest.
        self.runner: CachedModel = CompactMinion(model) if compact and supports(model) else CachedModel(model)
        if release_weights and isinstance(self.runner, CompactModel):
            self.runner.decoder.release_module_weights(model)
        self.model = model
        self.name = name
        self.vocab_size = self.runner.vocab_size

    def weight_bytes(self) -> int:
        return self.runner.weight_bytes()

    def reset(self) -> None:
        self.runner.reset()

    def use_slot(self, slot: int) -> None:
        """Make `slot`'s cache the one grow() extends: each request keeps its own cache
        in the runner (core/slots.py); the tree itself is rebuilt every grow."""
        self.runner.use_slot(slot)

    def drop_slot(self, slot: int) -> None:
        self.runner.drop_slot(slot)

    def prefill(self, context: list[int]) -> None:
        """Run everything but the root, which grow() runs with the tree."""
        self.runner.extend(self.runner.sync(context[:-1]))

    def grow(self, context: list[int], budget: GrowBudget) -> CandidateTree:
        tree = CandidateTree()
        if budget.max_nodes <= 0 or budget.max_depth <= 0:
            return tree
        start = self._run_root(context)
        if start is None:
            return tree
        root_logits, base_pos = start
        frontier = Frontier(tree, budget, ranked=budget.sampling is not None)

        def children(logits: torch.Tensor, parent: int) -> list[tuple[int, float]]:
            if budget.sampling is None:
                return _top_children(logits, budget.top_k)
            return drawn_children(logits, budget, tree, parent)

        frontier.offer(-1, children(root_logits, -1))
        anc = np.zeros((budget.max_nodes, budget.max_nodes), dtype=bool)
        while frontier.can_take():
            batch = frontier.take()
            for node in batch:
                parent = tree.parents[node]
                if parent >= 0:
                    anc[node] = anc[parent]
                anc[node, node] = True
            if not frontier.worth_running(batch):
                continue  # none of these can get children: the tree fills from what waits
            first = batch[0]  # batches are contiguous node ranges
            logits = self._run_nodes(tree, batch, anc[first:len(tree), :len(tree)],
                                     [frontier.depths[n] for n in batch], base_pos)
            for row, node in enumerate(batch):
                if frontier.may_expand(node):
                    frontier.offer(node, children(logits[row], node))
        # One distribution per parent that kept a child (each is vocab floats).
        kept_parents = set(tree.parents)
        tree.draws = {p: q for p, q in tree.draws.items() if p in kept_parents}
        return tree

    def _run_root(self, context: list[int]) -> tuple[torch.Tensor, int] | None:
        """Bring the cache up to the root and run it: (its logits, its position)."""
        runner = self.runner
        pending = runner.sync(context)
        if not pending:  # the root was run before: re-run it to get its distribution
            runner.truncate(len(context) - 1)
            pending = context[-1:]
        return runner.extend(pending)[-1], len(context) - 1

    def _run_nodes(self, tree: CandidateTree, batch: list[int], anc: np.ndarray, depths: list[int],
                   base_pos: int) -> torch.Tensor:
        """Logits of one tree-masked pass over `batch`'s nodes."""
        return self.runner.forward([tree.tokens[n] for n in batch], anc, depths, base_pos)

    def grow_ahead(self, budget: GrowBudget, window: AheadWindow) -> int:
        return 0

    def commit(self, accepted: list[int]) -> None:
        # Nothing to keep eagerly: the next grow() keeps the longest common prefix and
        # re-runs the few accepted tokens in the same pass as the new root.
        pass


def _top_children(logits: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most probable tokens with their log-probabilities, best first."""
    lp = torch.log_softmax(logits, dim=-1)
    top = torch.topk(lp, min(k, lp.shape[-1]))
    return list(zip(top.indices.tolist(), top.values.tolist()))
