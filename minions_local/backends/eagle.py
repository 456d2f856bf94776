"""A feature drafter (EAGLE's idea): one layer that drafts from the target's features.

A small model guessing the target's next token from the tokens alone has to know
what the target knows; a two-layer model distilled here reached 30% top-1 agreement
(scripts/train_drafter.py history). The target's own final hidden state at a
position (its *feature*: what its head turns into the next token's distribution)
already holds that knowledge, and the verify pass computes it for free. So this
minion reads features: its input at a position is the token there with the target's
feature at the position before, through one transformer layer, and its output is
its guess of the target's feature there, which the target's own head turns into a
distribution. Deeper in the tree no target feature exists yet, so each node feeds
its own guessed feature to its children.

    input i:  fc([embed(x[i+1]), f[i]]) -> layer -> norm -> f'[i+1] -> head -> x[i+2]

After a step the target has verified the root and the accepted path, so their
features are known (HFTarget.features_of) and the drafter re-runs those positions
from the real features before growing the next tree: its cache never holds a guess
for a committed position once the real feature is there.

Costs: one layer of the target's width plus its head: 3.5-4 ms a pass for SmolLM2
on two cores, the same for one node or thirty-two (bf16 matmuls on AMX are
memory-bound there).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from minions_local.backends.compact import CompactDecoder, CompactModel
from minions_local.backends.packing import pack_weight
from minions_local.backends.hf import CachedModel
from minions_local.backends.hf_minion import HFMinion
from minions_local.core.protocols import CandidateTree, common_prefix_len


class FeatureDecoder(CompactDecoder):
    """The compact forward with the drafter's input: fc([embedding, feature])."""

    def __init__(self, model, fc: torch.Tensor, **kwargs) -> None:
        self.fc = fc  # [d, 2d]; set before the base class packs the weights
        self.input_features: torch.Tensor | None = None
        super().__init__(model, **kwargs)

    def _pack(self) -> None:
        super()._pack()
        self.fc = pack_weight(self.fc)

    def weight_bytes(self) -> int:
        return super().weight_bytes() + self.fc.numel() * self.fc.element_size()

    def _inputs(self, ids: torch.Tensor) -> torch.Tensor:
        pair = torch.cat([F.embedding(ids, self.embed), self.input_features.to(self.dtype)], dim=-1)
        return self.linear(pair.unsqueeze(0), self.fc)


class FeatureRunner(CompactModel):
    """The drafter's cache and passes; every pass takes one feature per token."""

    exact = False

    SLOT_FIELDS = ("real",)

    def __init__(self, model, fc: torch.Tensor) -> None:
        CachedModel.__init__(self, model)
        self.decoder = FeatureDecoder(model, fc, exact=False)
        self.cache = None
        self.real = 0
        """Cache entries made from the target's real features (the rest: from zeros,
        e.g. the load-time timing on a made-up context); only these are reused. Per
        request, like the cache it describes."""

    def fresh_slot_state(self) -> dict:
        return super().fresh_slot_state() | {"real": 0}

    def reset(self) -> None:
        super().reset()
        self.real = 0

    def run(self, tokens: list[int], features: torch.Tensor, anc: np.ndarray, depths: list[int],
            base_pos: int, *, prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [T, V], or the last row's [1, V] for a `prefill` chunk, guessed
        features [T, d]) of a tree-masked pass."""
        self.decoder.input_features = features
        logits = self.forward(tokens, anc, depths, base_pos, prefill=prefill)
        return logits, self.decoder.last_hidden

    def extend_with(self, tokens: list[int], features: torch.Tensor, chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a chain (committed positions) and keep it; returns the last row's
        (logits, guessed feature)."""
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            n = len(part)
            logits, hidden = self.run(part, features[start:start + n], np.tril(np.ones((n, n), dtype=bool)),
                                      list(range(n)), self.cache_len, prefill=True)
            self.cached.extend(part)
        return logits[-1], hidden[-1]


class FeatureMinion(HFMinion):
    """Grows trees like any Hugging Face minion (best-first, one tree-masked pass per
    level); only the passes differ: each node's input carries its parent's feature."""

    shares_passes = False  # each pass pairs tokens with features: grow_batch goes request by request

    def __init__(self, runner: FeatureRunner, target, name: str) -> None:
        self.runner = runner
        self.model = runner.model
        self.name = name
        self.vocab_size = runner.vocab_size
        self.target = target
        target.keep_hidden = True  # from now on, every pass keeps its features
        # Each grow's tree nodes' guessed features, rebuilt from its root: nothing here
        # outlives a grow, so requests need no copy of their own (their caches and real
        # counts are per slot, in the runner).
        self._node_features: dict[int, torch.Tensor] = {}
        self._zero = torch.zeros(runner.decoder.embed.shape[1], dtype=runner.dtype, device=runner.device)

    def prefill(self, context: list[int]) -> None:
        """Nothing yet: the features come from the target's prefill, which may be
        running beside this call; the first grow reads the prompt with them."""

    def _run_root(self, context: list[int]) -> tuple[torch.Tensor, int] | None:
        if len(context) < 2:
            return None  # the first token has no feature before it
        inputs = context[1:]  # input i pairs token context[i + 1] with the target's feature i
        runner = self.runner
        real = self.target.features_of(context[:-1])
        keep = common_prefix_len(runner.cached, inputs)
        if len(real) > runner.real:  # real features arrived for entries made from zeros: redo those
            keep = min(keep, runner.real)
        keep = min(keep, len(inputs) - 1)  # the root is always run: its output starts the tree
        runner.truncate(keep)
        features = real[keep:len(inputs)]
        if features.shape[0] < len(inputs) - keep:  # positions the target has not run: zeros
            missing = len(inputs) - keep - features.shape[0]
            features = torch.cat([features.to(self._zero.dtype), self._zero.expand(missing, -1)])
        logits, root_feature = runner.extend_with(inputs[keep:], features)
        runner.real = min(len(inputs), len(real))
        self._node_features = {-1: root_feature}
        return logits, len(inputs) - 1

    def _run_nodes(self, tree: CandidateTree, batch: list[int], anc: np.ndarray, depths: list[int],
                   base_pos: int) -> torch.Tensor:
        parents = torch.stack([self._node_features[tree.parents[n]] for n in batch])
        logits, guessed = self.runner.run([tree.tokens[n] for n in batch], parents, anc, depths, base_pos)
        for row, node in enumerate(batch):
            self._node_features[node] = guessed[row]
        return logits
