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

from collections.abc import Sequence

import numpy as np
import torch

from minions_local.core.minion import BaseMinion
from minions_local.core.protocols import CandidateTree, GrowBudget
from minions_local.backends.compact import CompactModel, PassPart, supports
from minions_local.backends.frontier import Frontier, drawn_children
from minions_local.backends.hf import CachedModel


class CompactMinion(CompactModel):
    exact = False  # a minion's rounding need not match anyone's: the target decides


class HFMinion(BaseMinion):
    depth_is_free = False  # a deeper tree takes more forward passes
    shares_passes = True
    """Whether grow_batch/prefill_batch run several requests in one compact pass (a
    subclass whose passes take more than tokens, as FeatureMinion's do, says no)."""
    grows_ahead = False  # its passes would compete with the target's for torch's threads
    grows_batches = True
    requests_per_pass = 1
    # Its grows are priced request by request, as before grow_batch, though one compact
    # pass holds them all (passes_per_level). Priced as shared passes
    # (speculation/row_budget.py), the server soak's 16-request batches grew far more
    # trees through it and the server's memory kept rising for five rounds of 64
    # requests (72-137 MiB the second round, against ~11 priced alone) before levelling
    # off: where it goes is not found yet.

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

    def prefill_batch(self, requests: Sequence[tuple[int, Sequence[int]]]) -> None:
        """`prefill` for several requests, given as (slot, context): their prompts'
        chunks share passes of the compact forward (the weights run once over every
        request's rows), at most PREFILL_ROWS rows a pass."""
        runner = self.runner
        if not self._passes_shared():
            for slot, context in requests:
                runner.use_slot(slot)
                self.prefill(list(context))
            return
        pending: dict[int, list[int]] = {}
        for slot, context in requests:
            runner.use_slot(slot)
            todo = runner.sync(list(context[:-1]))
            if todo:
                pending[slot] = todo
        while pending:
            parts, room = [], self.PREFILL_ROWS
            for slot in list(pending):
                if room <= 0:
                    break
                runner.use_slot(slot)
                chunk, pending[slot] = pending[slot][:room], pending[slot][room:]
                n = len(chunk)
                part = runner.pass_part(chunk, np.tril(np.ones((n, n), dtype=bool)), list(range(n)), runner.cache_len)
                part.prefill = True
                runner.cached.extend(chunk)
                parts.append(part)
                room -= n
            runner.decoder.forward_parts(parts)
            pending = {slot: todo for slot, todo in pending.items() if todo}

    PREFILL_ROWS = 512
    """Prompt tokens one shared prefill pass reads at most (what `extend` reads in one
    chunk: bounds a pass's activations)."""

    def grow(self, context: list[int], budget: GrowBudget) -> CandidateTree:
        if budget.max_nodes <= 0 or budget.max_depth <= 0:
            return CandidateTree()
        start = self._run_root(context)
        if start is None:
            return CandidateTree()
        growing = _Growing(budget, *start)
        while (level := growing.next_level()) is not None:
            _, anc, depths = level
            growing.expand(self._run_nodes(growing.tree, growing.batch, anc, depths, growing.base_pos))
        return growing.done()

    def grow_batch(self, requests: Sequence[tuple[int, list[int], GrowBudget]]) -> list[CandidateTree]:
        """Grow several requests' trees, given as (slot, context, budget): their roots
        in one pass of the compact forward (each on its own slot's cache), then one
        pass per tree level for all of them (compact.py forward_parts: the weights run
        once over every request's rows). Each tree is grown as grow() grows it alone
        (a row's rounding may differ in a pass shared with others: a minion's need
        not match anyone's). Without the compact forward, one request after another."""
        runner = self.runner
        if not self._passes_shared():
            return [self._grow_on(slot, context, budget) for slot, context, budget in requests]
        trees: list[CandidateTree] = [CandidateTree() for _ in requests]
        roots: list[tuple[int, int, PassPart]] = []
        for i, (slot, context, budget) in enumerate(requests):
            if budget.max_nodes <= 0 or budget.max_depth <= 0:
                continue
            runner.use_slot(slot)
            pending = self._root_pending(context)
            if pending is None:
                continue
            if len(pending) > self.ROOT_CHUNK:  # a long catch-up reads alone, in chunks
                runner.extend(pending[:-1])
                pending = pending[-1:]
            n = len(pending)
            part = runner.pass_part(pending, np.tril(np.ones((n, n), dtype=bool)), list(range(n)), runner.cache_len)
            part.prefill = True  # only the root's logits
            runner.cached.extend(pending)
            roots.append((i, slot, part))
        if not roots:
            return trees
        logits = runner.decoder.forward_parts([part for _, _, part in roots])
        growing = {i: (slot, _Growing(requests[i][2], root[-1], len(requests[i][1]) - 1))
                   for (i, slot, _), root in zip(roots, logits)}
        while True:
            level = []
            for i, (slot, g) in growing.items():
                step = g.next_level()
                if step is not None:
                    runner.use_slot(slot)
                    tokens, anc, depths = step
                    level.append((g, runner.pass_part(tokens, anc, depths, g.base_pos)))
            if not level:
                break
            for (g, _), rows in zip(level, runner.decoder.forward_parts([part for _, part in level])):
                g.expand(rows)
        for i, (_, g) in growing.items():
            trees[i] = g.done()
        return trees

    def passes_per_level(self, requests: int) -> int:
        """One compact pass a tree level holds every request; without the compact
        forward (or where passes take more than tokens), grow_batch goes request by
        request."""
        return 1 if self._passes_shared() else requests

    def _passes_shared(self) -> bool:
        return self.shares_passes and isinstance(self.runner, CompactModel)

    ROOT_CHUNK = 64
    """Tokens to catch up beyond which a request's root runs alone (in grow_batch's
    root pass, a few accepted tokens and the root are what a request brings)."""

    def _grow_on(self, slot: int, context: list[int], budget: GrowBudget) -> CandidateTree:
        self.runner.use_slot(slot)
        return self.grow(context, budget)

    def _root_pending(self, context: list[int]) -> list[int] | None:
        """The tokens to run for the current slot's cache to reach the root, the root
        included (None: an empty context)."""
        if not context:
            return None
        runner = self.runner
        pending = runner.sync(context)
        if not pending:  # the root was run before: re-run it to get its distribution
            runner.truncate(len(context) - 1)
            pending = context[-1:]
        return pending

    def _run_root(self, context: list[int]) -> tuple[torch.Tensor, int] | None:
        """Bring the cache up to the root and run it: (its logits, its position)."""
        pending = self._root_pending(context)
        if pending is None:
            return None
        return self.runner.extend(pending)[-1], len(context) - 1

    def _run_nodes(self, tree: CandidateTree, batch: list[int], anc: np.ndarray, depths: list[int],
                   base_pos: int) -> torch.Tensor:
        """Logits of one tree-masked pass over `batch`'s nodes."""
        return self.runner.forward([tree.tokens[n] for n in batch], anc, depths, base_pos)

    def commit(self, accepted: list[int]) -> None:
        # Nothing to keep eagerly: the next grow() keeps the longest common prefix and
        # re-runs the few accepted tokens in the same pass as the new root.
        pass


class _Growing:
    """One tree growing best-first, a tree level (one pass's nodes) at a time: its
    passes run alone (grow) or beside other requests' (grow_batch)."""

    def __init__(self, budget: GrowBudget, root_logits: torch.Tensor, base_pos: int) -> None:
        self.tree = CandidateTree()
        self.budget = budget
        self.base_pos = base_pos
        self.frontier = Frontier(self.tree, budget, ranked=budget.sampling is not None)
        self.anc = np.zeros((budget.max_nodes, budget.max_nodes), dtype=bool)
        self.batch: list[int] = []
        self.frontier.offer(-1, self._children(root_logits, -1))

    def _children(self, logits: torch.Tensor, parent: int) -> list[tuple[int, float]]:
        if self.budget.sampling is None:
            return _top_children(logits, self.budget.top_k)
        return drawn_children(logits, self.budget, self.tree, parent)

    def next_level(self) -> tuple[list[int], np.ndarray, list[int]] | None:
        """The next pass's (tokens, visibility over the tree so far, depths); None when
        the tree is grown. Nodes whose children could not join the tree are added
        without a pass (Frontier.worth_running)."""
        frontier, tree = self.frontier, self.tree
        while frontier.can_take():
            batch = frontier.take()
            for node in batch:
                parent = tree.parents[node]
                if parent >= 0:
                    self.anc[node] = self.anc[parent]
                self.anc[node, node] = True
            if not frontier.worth_running(batch):
                continue  # none of these can get children: the tree fills from what waits
            self.batch = batch
            first = batch[0]  # batches are contiguous node ranges
            return ([tree.tokens[n] for n in batch], self.anc[first:len(tree), :len(tree)],
                    [frontier.depths[n] for n in batch])
        return None

    def expand(self, logits: torch.Tensor) -> None:
        """The last level's logits, one row per node: their children join the frontier."""
        for row, node in enumerate(self.batch):
            if self.frontier.may_expand(node):
                self.frontier.offer(node, self._children(logits[row], node))

    def done(self) -> CandidateTree:
        tree = self.tree
        # One distribution per parent that kept a child (each is vocab floats).
        kept_parents = set(tree.parents)
        tree.draws = {p: q for p, q in tree.draws.items() if p in kept_parents}
        return tree


def _top_children(logits: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most probable tokens with their log-probabilities, best first."""
    lp = torch.log_softmax(logits, dim=-1)
    top = torch.topk(lp, min(k, lp.shape[-1]))
    return list(zip(top.indices.tolist(), top.values.tolist()))
