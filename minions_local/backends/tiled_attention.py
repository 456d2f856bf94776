"""Prompt attention whose every row is the same bits however the prompt is chunked.

A prompt's cache entries are reused: by the conversation's next turn, and by any later
request that shares a prefix with it (a server's requests share the chat template's
system prompt). The reply a prompt gets must not depend on which earlier request
computed those entries, nor on how many rows ran beside them. torch's fused attention
does not promise that: its CPU kernel blocks the queries by the chunk's length, and
matmuls pick their kernels by shape (measured: SmolLM2's shapes, a 7-row chunk and a
200-row chunk round rows differently from a 1500-row one, in bfloat16 and float32).
On a server that flipped near-ties: 4 of 8 replies differed from the target alone.

So every matmul here has one shape, whatever the chunk: queries in tiles of QUERY_TILE
rows aligned to absolute positions (row p is always row p % QUERY_TILE of its tile,
padded rows fill the rest), keys in blocks of KEY_BLOCK aligned the same way, and a
softmax that runs block after block (the online form of flash attention). A row's
running maximum, sum and output depend only on its own scores; a block that is wholly
masked for it adds exact zeros and scales by exactly 1. Element-wise ops see sizes that
are multiples of the vector width, so no element falls into a scalar tail. The load
check (hf_target.chunking_differs) confirms it on the machine at hand.

It computes in float32 whatever the model's dtype, and costs ~1.3x the fused kernel
(SmolLM2's shapes, a 1500-token prompt in 512-token chunks on a 2-core AVX-512 EPYC:
41 ms a layer against 32; tiles of 64 or key blocks of 256 measured slower).
"""

from __future__ import annotations

import torch

QUERY_TILE = 128
"""Query rows per tile (a multiple of 16: no scalar tail in element-wise ops)."""
KEY_BLOCK = 128
"""Keys per block."""


def attend_prompt(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention [1, H, T, hd] for a prompt chunk at positions start..start+T-1.

    q: [1, H, T, hd]; keys/values: [kv_heads, capacity, hd], a cache whose first
    start + T entries hold the prefix and the chunk, and whose capacity reaches the next
    multiple of KEY_BLOCK (CompactDecoder._reserve keeps it so; the entries past the
    chunk are masked, and must only be finite)."""
    _, heads, t, hd = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    first_tile, end = start // QUERY_TILE, start + t
    tiles = -(-end // QUERY_TILE) - first_tile
    lead = start - first_tile * QUERY_TILE
    rows = tiles * QUERY_TILE
    # [kv_heads, tiles, group * QUERY_TILE, hd]: each tile's rows for every query head
    # sharing a key head (GQA), so one matmul per tile and key block.
    padded = q.new_zeros(1, heads, rows, hd)
    padded[:, :, lead:lead + t] = q
    tiled = (padded.float() * hd ** -0.5).view(kv_heads, group, tiles, QUERY_TILE, hd)
    tiled = tiled.transpose(1, 2).reshape(kv_heads, tiles, group * QUERY_TILE, hd)
    positions = torch.arange(first_tile * QUERY_TILE, first_tile * QUERY_TILE + rows, device=q.device)
    row_pos = positions.view(tiles, 1, QUERY_TILE, 1).expand(tiles, group, QUERY_TILE, 1).reshape(tiles, -1, 1)

    blocks = -(-end // KEY_BLOCK)
    keys32 = keys[:, :blocks * KEY_BLOCK].float().view(kv_heads, blocks, KEY_BLOCK, hd).transpose(-1, -2)
    values32 = values[:, :blocks * KEY_BLOCK].float().view(kv_heads, blocks, KEY_BLOCK, hd)
    best = tiled.new_full((kv_heads, tiles, group * QUERY_TILE, 1), float("-inf"))
    total = torch.zeros_like(best)
    out = torch.zeros_like(tiled)
    key_offsets = torch.arange(KEY_BLOCK, device=q.device)
    tile_starts = [(first_tile + i) * QUERY_TILE for i in range(tiles)]
    for j in range(blocks):
        # The tiles that see some of block j are those ending at or after its start,
        # a suffix of the tiles (skipping a block wholly masked for a row is exact);
        # only those starting before its end need the causal mask.
        first = next(i for i in range(tiles) if tile_starts[i] + QUERY_TILE > j * KEY_BLOCK)
        masked = sum(1 for i in range(first, tiles) if tile_starts[i] < (j + 1) * KEY_BLOCK - 1)
        scores = tiled[:, first:] @ keys32[:, j:j + 1]
        if masked:
            visible = (j * KEY_BLOCK + key_offsets) <= row_pos[first:first + masked]
            scores[:, :masked].masked_fill_(~visible, float("-inf"))
        new_best = torch.maximum(best[:, first:], scores.amax(dim=-1, keepdim=True))
        scale = torch.exp(best[:, first:] - new_best)
        probs = torch.exp(scores.sub_(new_best))
        total[:, first:].mul_(scale).add_(probs.sum(dim=-1, keepdim=True))
        out[:, first:].mul_(scale).add_(probs @ values32[:, j:j + 1])
        best[:, first:] = new_best
    out = (out / total).view(kv_heads, tiles, group, QUERY_TILE, hd).transpose(1, 2)
    out = out.reshape(1, heads, rows, hd)[:, :, lead:lead + t]
    return out.to(q.dtype)
