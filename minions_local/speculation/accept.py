"""Which part of a verified tree the target accepts.

Greedy: follow the target's argmax down the tree; the first argmax that is not a
child is the bonus token. This is token-identical to the target decoding alone.

Sampling: at each node draw from the target's processed distribution and descend
when the draw is a child (SpecExec's rule). The tree is fixed before the target's
randomness is used, so the committed sequence is distributed exactly as if the
target had sampled one token at a time: each token is a draw from the target's
distribution given the tokens before it; the tree only decides how many of those
draws one pass can serve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import TokenTree


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the target samples from after temperature, top-k and top-p.

    Works on the last dimension, for one row or many.
    """
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest set whose mass reaches top_p (always at least the top token).
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def accept(
    tree: TokenTree,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    max_accept: int | None = None,
) -> tuple[list[int], int]:
    """Walk the tree with the target's verdicts.

    logits: [T, V], row i is the target's next-token logits after node i.
    Returns (accepted path as node indices starting at the root, bonus token).
    `max_accept` caps the draft nodes taken (the bonus token is still the target's
    own choice after the last one), so a length limit never costs exactness.
    """
    path = [0]
    node = 0
    while True:
        row = logits[node]
        if params.greedy:
            token = int(torch.argmax(row))
        else:
            probs = processed_probs(row, params)
            token = int(torch.multinomial(probs, 1, generator=generator))
        child = tree.children[node].get(token)
        if child is None or (max_accept is not None and len(path) - 1 >= max_accept):
            return path, token
        path.append(child)
        node = child
