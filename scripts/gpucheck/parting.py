"""Where a speculative reply parts from the target alone's, and whether a near-tie explains it.

Greedy speculative decoding replies as the target alone does. In float32, and in bf16
on the CPU (whose tree rows are row-invariant: backends/compact.py), that holds token
for token. On CUDA the target runs transformers' forward, whose bf16 matmuls round a
row differently with the number of rows in the pass: a tree pass and a 1-token pass
can then pick different tokens where the target's best two are within that rounding
of each other. Such a parting is no bug, and switching to float32 would only hide how
often it happens, so it is measured instead. A parting anywhere else is a bug.

At the first parting, on the target alone's logits there (its prefix read as one
cached row, as autoregressive decoding reads it):
- top2_margin: the best logit minus the second;
- pair_margin: the gap between the two tokens the replies took;
- rounding: how far the same logits move when that position is instead the last row
  of a full pass (the largest change among the 8 best tokens): the pass-shape rounding
  of this machine, measured where it matters.
It is a near-tie when pair_margin <= max(4 x rounding, 4 ulps of the best logit in
the compute dtype): an ulp floor, because one measured pair of shapes can happen to
agree at a position where the tree pass's shape does not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from minions_local.backends.hf import cache_kwargs

ROUNDING_FACTOR = 4.0
ULP_FLOOR = 4.0
TOP = 8


@dataclass
class Parting:
    position: int
    """Index in the reply of the first token that differs."""
    ours: int | None
    """What the speculative reply took there (its stop token if it stopped; None: unknown)."""
    alone: int | None
    top2_margin: float
    pair_margin: float | None
    rounding: float
    tolerance: float
    in_top2: bool
    near_tie: bool

    def as_json(self) -> dict:
        out = asdict(self)
        for key in ("top2_margin", "pair_margin", "rounding", "tolerance"):
            if out[key] is not None:
                out[key] = round(out[key], 5)
        return out


def first_parting(ours: list[int], alone: list[int]) -> int | None:
    """The first index where two replies differ (a reply that stopped early differs
    where the other goes on); None when they are the same."""
    for i, (a, b) in enumerate(zip(ours, alone)):
        if a != b:
            return i
    return None if len(ours) == len(alone) else min(len(ours), len(alone))


@torch.no_grad()
def logits_two_ways(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The last position's logits (float32) read as one cached row, and as the last
    row of one full pass over `ids`."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    full = model(input_ids=x).logits[0, -1].float()
    cache = DynamicCache()
    if len(ids) > 1:
        model(input_ids=x[:, :-1], **cache_kwargs(model, cache), use_cache=True)
    one = model(input_ids=x[:, -1:], **cache_kwargs(model, cache), use_cache=True).logits[0, -1].float()
    return one, full


def judge(model, prompt: list[int], ours: list[int], alone: list[int], stop: int | None) -> Parting | None:
    """The first parting of `ours` from `alone` (both replies to `prompt`), measured on
    `model` (the target, resident, in the dtype and on the device under test); None
    when the replies are the same. `stop`: the token a reply that stopped early took."""
    i = first_parting(ours, alone)
    if i is None:
        return None
    one, full = logits_two_ways(model, prompt + alone[:i])
    dtype = next(model.parameters()).dtype
    top = torch.topk(one, TOP)
    best = float(top.values[0])
    top2_margin = float(top.values[0] - top.values[1])
    rounding = float((one[top.indices] - full[top.indices]).abs().max())
    tolerance = max(ROUNDING_FACTOR * rounding, ULP_FLOOR * torch.finfo(dtype).eps * max(abs(best), 1.0))
    a = ours[i] if i < len(ours) else stop
    b = alone[i] if i < len(alone) else stop
    pair = None if a is None or b is None else abs(float(one[a] - one[b]))
    top2 = set(top.indices[:2].tolist())
    in_top2 = a in top2 and b in top2
    return Parting(position=i, ours=a, alone=b, top2_margin=top2_margin, pair_margin=pair, rounding=rounding,
                   tolerance=tolerance, in_top2=in_top2, near_tie=pair is not None and pair <= tolerance)
