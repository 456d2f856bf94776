"""Attention for the compact forward: one sequence's rows over its cache, or many
sequences' rows over their own caches in one batched call.

A shared pass (continuous batching) holds a few rows of each of P requests. Attending
part by part costs ~15 small ops per part and layer (a float64 round trip, two matmuls,
the softmax...), and a CPU pays ~10 us an op whatever its size: at 16 requests that was
~2900 matmuls a pass. `attend_parts` pads the parts' queries, keys, values and masks
into [P, ...] tensors and runs each op once. Padding keys are masked out (their weight
is exactly 0) and padding query rows are thrown away, so each part's rows are what it
gets alone up to the summation order of float arithmetic, which the float64
row-invariant path rounds away (see `attend`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
           row_invariant: bool) -> torch.Tensor:
    """Masked attention [B, H, T, hd] of queries [B, H, T, hd] over keys and values
    [B, kv_heads, L, hd] with an additive mask [B, 1, T, L].

    Row invariance: a bf16 tree pass must give each row what the 1-token pass of
    autoregressive decoding gives, or a near-tie between the two best tokens flips
    and greedy output drifts from the target's own (measured on SmolLM2, 8 chat
    replies: 1 identical before this). Norms and RoPE act row by row, and the linear
    layers do once a 1-token pass runs as two rows (compact.py `_linear`); attention
    does not, since the rows and masked keys sharing a pass change how a row's terms
    are summed. In float64 that changes a row by ~1e-16 of its size, which rounding
    back to the compute dtype erases, so every row comes out as it would alone. The cost
    is small: attention is a few % of a small batch's FLOPs."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    if not row_invariant:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=heads != kv_heads)
    b, _, t, hd = q.shape
    length = keys.shape[2]
    # Query heads sharing a key/value head (GQA) run as one matmul against it.
    grouped = q.double().reshape(b, kv_heads, heads // kv_heads * t, hd)
    scores = (grouped @ keys.double().transpose(-1, -2)).view(b, heads, t, length)
    probs = torch.softmax(scores * hd ** -0.5 + mask.double(), dim=-1)
    out = probs.view(b, kv_heads, heads // kv_heads * t, length) @ values.double()
    return out.view(b, heads, t, hd).to(q.dtype)


def attend_parts(q: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]], masks: list[torch.Tensor],
                 spans: list[tuple[int, int]], *, row_invariant: bool) -> torch.Tensor:
    """Each part's rows q[:, :, a:b] (`spans`) over its own keys and values (`caches`:
    [kv_heads, L_p, hd] each) under its own mask [1, 1, T_p, L_p], in one batched call.
    Returns [1, H, T, hd] in the parts' row order."""
    p, heads, hd = len(spans), q.shape[1], q.shape[3]
    kv_heads = caches[0][0].shape[0]
    t_max = max(b - a for a, b in spans)
    l_max = max(k.shape[1] for k, _ in caches)
    dtype = torch.float64 if row_invariant else q.dtype
    queries = q.new_zeros((p, heads, t_max, hd), dtype=dtype)
    keys = q.new_zeros((p, kv_heads, l_max, hd), dtype=dtype)
    values = q.new_zeros((p, kv_heads, l_max, hd), dtype=dtype)
    # Padding keys get no weight; a padding query row sees every key (no row of -inf,
    # whose softmax is NaN) and is dropped.
    mask = q.new_full((p, 1, t_max, l_max), float("-inf"), dtype=dtype)
    for n, ((a, b), (k, v), m) in enumerate(zip(spans, caches, masks)):
        queries[n, :, : b - a] = q[0, :, a:b]
        keys[n, :, : k.shape[1]] = k
        values[n, :, : v.shape[1]] = v
        mask[n, 0, : b - a, : m.shape[-1]] = m[0, 0]
        mask[n, 0, b - a:] = 0
    out = attend(queries, keys, values, mask, row_invariant=row_invariant).to(q.dtype)
    return torch.cat([out[n, :, : b - a] for n, (a, b) in enumerate(spans)], dim=1).unsqueeze(0)
