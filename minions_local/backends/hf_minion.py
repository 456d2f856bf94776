"""A Hugging Face minion: grows its candidate tree best-first by path probability.

Each forward pass expands the `width` most probable frontier nodes at once (a
tree-masked batch), so a tree of depth D costs about D small passes; width 1 is a
plain draft chain. Nodes added in the last round are never run: their scores come
from their parents' distributions, and nobody will expand them this step.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import torch

from .base import CandidateTree, GrowBudget
from .compact import CompactModel, supports


class CompactMinion(CompactModel):
    exact = False  # a minion's rounding need not match anyone's: the target decides
from .hf import CachedModel


class HFMinion:
    def __init__(self, model, name: str, compact: bool = True) -> None:
        # The compact forward is the same math with a fraction of the framework
        # overhead, which is most of a small model's time; transformers runs the rest.
        self.runner: CachedModel = CompactMinion(model) if compact and supports(model) else CachedModel(model)
        self.model = model
        self.name = name
        self.vocab_size = self.runner.vocab_size

    def reset(self) -> None:
        self.runner.reset()

    def prefill(self, context: list[int]) -> None:
        """Run everything but the root, which grow() runs with the tree."""
        self.runner.extend(self.runner.sync(context[:-1]))

    def grow(self, context: list[int], budget: GrowBudget) -> CandidateTree:
        tree = CandidateTree()
        if budget.max_nodes <= 0 or budget.max_depth <= 0:
            return tree
        runner = self.runner
        pending = runner.sync(context)
        if not pending:  # the root was run before: re-run it to get its distribution
            runner.truncate(len(context) - 1)
            pending = context[-1:]
        root_logits = runner.extend(pending)[-1]
        base_pos = len(context) - 1  # the root's position
        order = itertools.count()  # tie-breaker: earlier candidates first
        frontier: list[tuple[float, int, int, int, float, int]] = []

        def offer(logits: torch.Tensor, parent: int, parent_lp: float, depth: int) -> None:
            if depth > budget.max_depth:
                return
            lp = torch.log_softmax(logits, dim=-1)
            top = torch.topk(lp, min(budget.top_k, lp.shape[-1]))
            for v, t in zip(top.values.tolist(), top.indices.tolist()):
                heapq.heappush(frontier, (-(parent_lp + v), next(order), parent, t, parent_lp + v, depth))

        offer(root_logits, -1, 0.0, 1)
        anc = np.zeros((budget.max_nodes, budget.max_nodes), dtype=bool)
        depths: list[int] = []
        while frontier and len(tree) < budget.max_nodes:
            batch = []
            while frontier and len(batch) < min(budget.width, budget.max_nodes - len(tree)):
                _, _, parent, token, lp, depth = heapq.heappop(frontier)
                node = tree.add(token, parent, lp)
                if parent >= 0:
                    anc[node] = anc[parent]
                anc[node, node] = True
                depths.append(depth)
                batch.append(node)
            if len(tree) >= budget.max_nodes or all(depths[n] >= budget.max_depth for n in batch):
                break
            first = batch[0]  # batches are contiguous node ranges
            logits = runner.forward([tree.tokens[n] for n in batch], anc[first:len(tree), :len(tree)],
                                  [depths[n] for n in batch], base_pos)
            for row, node in enumerate(batch):
                offer(logits[row], node, tree.logprobs[node], depths[node] + 1)
        return tree

    def commit(self, accepted: list[int]) -> None:
        # Nothing to keep eagerly: the next grow() keeps the longest common prefix and
        # re-runs the few accepted tokens in the same pass as the new root.
        pass
