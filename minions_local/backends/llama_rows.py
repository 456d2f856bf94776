"""The rows of a llama.cpp target's pass, and how they go through llama_decode so that
every row computes the bits it would in a 1-token pass (llama_target.py's docstring
gives the rules): a tree laid out as rows, one sequence id per leaf; the calls a pass
is cut into; the dummy row beside a lone row where the file's types need one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from minions_local.backends.llama_cells import KVCache
from minions_local.core.tree import TokenTree

FLOAT_KV_ROWS = 63
"""Rows per llama_decode with a float16/float32 KV cache: below 64, where ggml's flash
attention switches to its tiled kernel (GGML_FA_TILE_Q)."""
QUANTIZED_KV_ROWS = 512
"""Rows per llama_decode with a q8_0 KV cache: ggml's flash attention has only its per-row
kernel for quantized keys (neither the tiled one nor the one splitting a lone row's keys
over threads), so a pass of hundreds of rows is one call, its weights read once."""
LONE_ROW_TYPES = {"F16", "BF16", "F32", "IQ4_NL"}
"""Weight types that llamafile's sgemm multiplies from 2 rows up, rounding otherwise than
the 1-row kernel: a file with such matrices never runs a lone row."""

KV_TYPES = {"f16": 1, "f32": 0, "q8_0": 8}  # GGML_TYPE_*


class Row(NamedTuple):
    """One token of a pass: at `pos` in every sequence of `seqs`; `output`: its logits are read."""

    token: int
    pos: int
    seqs: tuple[int, ...]
    output: bool


@dataclass
class TreeLayout:
    """Where one request's tree went in the pass, for its commit."""

    base: int
    """The root's position (the request's context length - 1)."""
    cells: list[int]
    """Per node: its cell."""
    leaf_seq: list[int]
    """Per node: the sequence of a leaf below it (whose cells include the node's path)."""
    seqs: list[int] = field(default_factory=list)
    """The tree's leaf sequences."""
    kept: bool = True
    """False: its cells were dropped after the pass (LlamaTarget.verify_batch)."""


def lay_out(tree: TokenTree, base: int, free_seqs: list[int]) -> tuple[TreeLayout, list[int], list[tuple[int, ...]]]:
    """A tree's rows: its nodes depth first, each node's children best (highest score)
    first; a sequence per leaf, taken from `free_seqs` (lowest first); per node the
    sequences of the leaves below it. Returns the layout, the node order, and per node
    its sequences."""
    children: list[list[int]] = [[] for _ in range(len(tree))]
    for n in range(1, len(tree)):
        children[tree.parents[n]].append(n)
    order, stack = [], [0]
    while stack:
        n = stack.pop()
        order.append(n)
        stack += sorted(children[n], key=lambda c: (tree.scores[c], -c))  # best popped first
    leaves = [n for n in order if not children[n]]
    if len(leaves) > len(free_seqs):
        raise RuntimeError(f"a tree of {len(leaves)} leaves needs more sequence ids than the target's "
                           f"context has free ({len(free_seqs)})")
    leaf_seq = {n: free_seqs.pop() for n in leaves}
    below: list[list[int]] = [[] for _ in range(len(tree))]
    for leaf, seq in leaf_seq.items():
        n = leaf
        while n >= 0:
            below[n].append(seq)
            n = tree.parents[n]
    layout = TreeLayout(base, [], [b[0] for b in below], list(leaf_seq.values()))
    return layout, order, [tuple(b) for b in below]


@dataclass
class RowCalls:
    """Runs a pass's rows in llama_decode calls of at most `max_rows` rows, and never one
    unless `lone_rows` (else a lone row takes a dummy beside it, in sequence `dummy_seq`);
    each call reads at least 2 output rows when it reads any."""

    lib: Any
    ctx: Any
    batch: Any
    """A llama_batch of `max_rows + 1` rows."""
    cache: KVCache
    vocab_size: int
    max_rows: int
    lone_rows: bool
    dummy_seq: int
    after_call: Any = None
    """Called after each llama_decode (the page-cache streamer's `decode_done`)."""

    def run(self, rows: list[Row]) -> tuple[np.ndarray, list[int]]:
        """The logits of the rows marked `output`, in order, and each row's cell."""
        lib, batch = self.lib, self.batch
        out = np.empty((sum(r.output for r in rows), self.vocab_size), dtype=np.float32)
        cells: list[int] = []
        got = 0
        for part in split_calls(len(rows), self.max_rows):
            calls = rows[part.start:part.stop]
            dummy = len(calls) == 1 and not self.lone_rows
            if dummy:  # a pass of one row: another row, in a sequence of its own, keeps it on 2
                calls = calls + [Row(calls[0].token, 0, (self.dummy_seq,), True)]
            outputs = [r.output for r in calls]
            if sum(outputs) == 1 and len(calls) > 1:  # the last layer and the head run on 2 rows, as in a tree
                outputs[next(i for i, o in enumerate(outputs) if not o)] = True
            batch.n_tokens = len(calls)
            for j, r in enumerate(calls):
                batch.token[j] = r.token
                batch.pos[j] = r.pos
                batch.n_seq_id[j] = len(r.seqs)
                for k, s in enumerate(r.seqs):
                    batch.seq_id[j][k] = s
                batch.logits[j] = outputs[j]
            status = lib.llama_decode(self.ctx, batch)
            if self.after_call is not None:
                self.after_call()
            if status != 0:
                raise RuntimeError(f"llama_decode failed with status {status} ({len(calls)} rows)")
            placed = self.cache.ledger.append([r.pos for r in calls], [r.seqs for r in calls])
            for j, r in enumerate(calls[:len(calls) - dummy]):
                cells.append(placed[j])
                if r.output:
                    out[got] = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, j), shape=(self.vocab_size,))
                    got += 1
            if dummy:
                self.cache.rm(self.dummy_seq)  # the top cell: freed in place
        return out, cells


def has_lone_row_types(path: Path) -> bool:
    """Whether the model (every shard of it) has weight matrices of LONE_ROW_TYPES."""
    from minions_local.models.gguf_file import read_model

    model = read_model(path)
    return any(t.type_name in LONE_ROW_TYPES and len(t.shape) >= 2 for f in model.files for t in f.tensors.values())


def split_calls(n: int, size: int) -> list[range]:
    """0..n in consecutive ranges of at most `size`, none of exactly one unless n == 1."""
    parts = [range(i, min(i + size, n)) for i in range(0, n, size)]
    if len(parts) > 1 and len(parts[-1]) == 1:
        a, b = parts[-2], parts[-1]
        parts[-2:] = [range(a.start, a.stop - 1), range(a.stop - 1, b.stop)]
    return parts
