"""A GGUF target computed by llama.cpp itself: ggml's quantized kernels multiply the
file's blocks (Q4_K, Q6_K, IQ4_NL, ...) against 8-bit activations, never widened, for
every architecture and type llama.cpp's loader knows.

A tree is one pass. Each leaf of the tree gets a sequence id of its own, and every node
carries the sequence ids of the leaves below it, so a node belongs to exactly the
sequences of the branches through it; the request's prefix is copied into every leaf's
sequence first (llama_memory_seq_cp adds a sequence id to existing cells, nothing is
copied). llama.cpp lets a token attend to the cells of its (first) sequence up to its own
position: its prefix, its ancestors and itself. That is the tree mask. Several
requests' trees (and newcomers' prompt pieces) share the pass as rows of one batch,
each request owning a prefix sequence. Commit adds the request's sequence to the
accepted path's cells and drops the leaf sequences.

Exact, as every target: a row gets the bits it would get in a 1-token pass of the
target decoding that conversation alone from an empty cache, whatever tree, batch,
chunking or cached prefix it met. llama.cpp by default is not (rows differ by up to 2.4
in the logits between batch sizes); these settings make it so, each checked on the
loaded file at load (llama_load.rows_differ):
  - flash attention on, over a q8_0 KV cache: ggml's CPU flash attention then has only
    its per-row kernel (over a float16 cache, 64+ rows take a tiled kernel and a lone row
    over 512+ cells one that splits the keys between threads, so there passes hold at
    most 63 rows and never one);
  - no weight repacking of ggml's own (its repacked kernels multiply rows in groups of 4 and
    the rest apart). A model held in RAM (`interleave`) takes one repacked layout, ours:
    each Q4_K matrix interleaved at load for the tiled kernel's 16-row form
    (GGML_CPU_TILED_REPACK, scripts/llama_cpp_patches), whose outputs are the bits of the
    file's layout at every row count (a pass of 4 rows 0.27 s against 0.35-0.41 on the
    8B-shaped Q4_K_M, 2 AVX-512 EPYC cores); and one matmul kernel at every row count for K- and
    I-quants (GGML_CPU_TILED_MM_FORCE, llama_context.import_llama_cpp): ggml's tiled kernel,
    which it otherwise takes only from 8 rows, `vec_dot` below (each is row-invariant on
    its own: per output element, the same sum in the same order, whatever the other rows);
  - at least 2 output rows per llama_decode of 2 rows or more: the last layer and the
    head run only on output rows, and llamafile's sgemm (F16, BF16, IQ4_NL: a file with
    those never runs a lone row) takes 2 rows and up;
  - every sequence's cells in position order (llama_cells.py: attention sums cells in
    cell order).
A row's keys and values are then what a prompt read of the same tokens writes, so a
request's decoded entries stay valid prompt entries: a chat's next turn reads only its
new tokens, and another request whose prompt starts the same way borrows them.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minions_local.backends.llama_cells import KVCache
from minions_local.backends.llama_context import buffer_report, ggml_function, import_llama_cpp, load_model_file
from minions_local.backends.llama_early import claim_early_model
from minions_local.backends.llama_rows import (FLOAT_KV_ROWS, KV_TYPES, QUANTIZED_KV_ROWS, Row, RowCalls, TreeLayout,
                                               has_lone_row_types, lay_out)
from minions_local.backends.llama_stream import PageCacheStreamer
from minions_local.core.errors import ContextOverflowError, ModelLoadError
from minions_local.core.protocols import PromptChunk, SlotTree, common_prefix_len
from minions_local.core.slots import SlotStates
from minions_local.profile.gguf_sizes import llama_sequences
from minions_local.core.tree import TokenTree

class LlamaTarget(SlotStates):
    """The Target protocol on llama.cpp (core/protocols.py): several requests' trees in
    one pass, each request on a slot owning one sequence of a shared context.

    Keyword arguments:
        n_ctx: KV cells in all (every slot's tokens, the trees of a pass, and garbage
            waiting to be compacted: llama_cells.py).
        threads: llama.cpp threads for a pass (default: every core, at most 8).
        kv_type: "q8_0" (the default: the only type whose attention kernel is the same for
            any row count, so that passes may hold 512 rows and lone rows need no partner;
            also half the memory of "f16"), "f16" (llama.cpp's default: passes of at most 63
            rows, never one) or "f32".
        lone_rows: whether a 1-row pass computes as a row among others for this file's
            weight types (None: read from the file; False where it has F16, BF16 or IQ4_NL
            matrices: see llama_rows.LONE_ROW_TYPES).
        sequences: sequence ids of the context (<= 256): each slot holds one, each tree
            leaf of a pass one. llama.cpp keeps a vocabulary-sized logits row per
            sequence, so the default keeps those rows within 64 MiB.
        n_gpu_layers: layers a CUDA/Metal build of llama.cpp runs on the GPU.
    """

    shares_passes = True
    new_shapes_cost_more = False
    """Whether a pass of a shape not run before costs more than the next of that shape
    (over RPC: the servers are asked allocation sizes, llama_remote.py)."""
    SLOT_FIELDS = ("_seq", "cached")

    def __init__(self, path: str | os.PathLike[str], *, n_ctx: int = 4096, threads: int | None = None,
                 kv_type: str = "q8_0", sequences: int | None = None, n_gpu_layers: int = 0,
                 lone_rows: bool | None = None, streamer: PageCacheStreamer | None = None,
                 interleave: bool = False) -> None:
        self.path = Path(path).expanduser()
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(KV_TYPES)}, got {kv_type!r}")
        self.lib = lib = import_llama_cpp()
        self.model = self.ctx = self.batch = None  # so close() works after a failed load
        self._special: tuple[int | None, set[int]] | None = None
        mparams = self._model_params(n_gpu_layers)
        mparams.use_extra_bufts = interleave and streamer is None  # a copy made at load does not stream
        # loaded already where its path was known early (llama_early.py)
        self.model = claim_early_model(self.path, n_gpu_layers=n_gpu_layers, interleave=mparams.use_extra_bufts,
                                       prefetch=streamer is None) if type(self) is LlamaTarget else None
        if not self.model:
            self.model = load_model_file(lib, self.path, mparams, interleave=mparams.use_extra_bufts,
                                         prefetch=streamer is None)
        if not self.model:
            raise ModelLoadError(f"llama.cpp could not load {self.path}: is it a complete GGUF model file of an "
                                 f"architecture this llama.cpp knows?")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self.vocab))
        self.device = torch.device("cpu")
        self.threads = threads or max(1, min(os.cpu_count() or 1, 8))
        if lone_rows is None:
            lone_rows = not has_lone_row_types(self.path)
        if sequences is None:
            sequences = llama_sequences(self.vocab_size)
        self.sequences = sequences
        self.streamer = streamer
        """Steers the page cache under the file when some layers stream (llama_stream.py)."""
        self._on_node = None
        if streamer is not None:
            get_name = ggml_function("ggml_get_name", ctypes.c_char_p, [ctypes.c_void_p])
            streamer._name = get_name
            self._on_node = lib.ggml_backend_sched_eval_callback(lambda t, ask, _: streamer.on_node(t, ask))
        self.buffers: dict[str, int] = {}
        """Bytes llama.cpp reported allocating for the context ("KV", "output", "compute")."""
        for kv in dict.fromkeys((kv_type, "f16")):  # q8_0 keys need a head size of 32s: else float16
            self.kv_type = kv
            self.max_rows = QUANTIZED_KV_ROWS if kv == "q8_0" else FLOAT_KV_ROWS
            """Rows per llama_decode (see FLOAT_KV_ROWS, QUANTIZED_KV_ROWS)."""
            self.lone_rows = lone_rows and kv == "q8_0"
            """Whether a llama_decode may run one row (else a dummy row joins it)."""
            with buffer_report() as self.buffers:
                self.ctx = lib.llama_init_from_model(self.model, self._context_params(n_ctx, kv))
            if self.ctx:
                break
        if not self.ctx:
            self.close()
            raise ModelLoadError(f"llama.cpp could not make a context of {n_ctx} cells for {self.path}: too "
                                 f"little memory? Lower the context size.")
        if streamer is not None and not streamer.attach():
            self.close()
            raise ModelLoadError(f"llama.cpp did not map {self.path} into memory, so its layers cannot stream.")
        self.batch = lib.llama_batch_init(self.max_rows + 1, 0, sequences)
        self.DUMMY = sequences - 1
        self.cache = KVCache(lib, self.ctx, garbage_seq=sequences - 2)
        self.calls = RowCalls(lib, self.ctx, self.batch, self.cache, self.vocab_size, self.max_rows, self.lone_rows,
                              dummy_seq=self.DUMMY, after_call=streamer.decode_done if streamer is not None else None)
        self._free_seqs = list(range(sequences - 3, -1, -1))  # pop() takes the lowest
        self._pending: dict[int, TreeLayout] = {}
        """Per slot: its tree in the last pass, until its commit."""
        self.passes = 0
        self.first_passes: list[tuple[int, float]] = []
        """(rows - 1, seconds) of its first passes (those of the exactness check at load,
        llama_load.rows_differ): the cost model's timed samples, at no further pass. None
        where a new shape's first pass costs more than decoding pays (new_shapes_cost_more)."""
        self.pass_shape: list[tuple[int, float]] = []
        """(draft nodes, seconds) of this model's passes as its cut's timed passes say
        (llama_check_model.py: scaled by pass_bytes_ratio), set by the load: the cost
        model's first samples, with no pass of the model held in memory, and one of a
        streamed model (its reads: llama_load._with_reads)."""
        self.trees_apart = 0
        """Trees verified in a pass of their own for want of sequence ids (verify_batch)."""
        self.__dict__.update(self.fresh_slot_state())

    def _model_params(self, n_gpu_layers: int) -> Any:
        """How llama.cpp loads the model (a split over RPC servers adds them: llama_remote.py)."""
        mparams = self.lib.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        mparams.use_extra_bufts = False  # ggml's repacked kernels multiply rows in groups: not row-invariant
        return mparams

    def _context_params(self, n_ctx: int, kv_type: str) -> Any:
        lib = self.lib
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = self.max_rows
        cparams.n_seq_max = self.sequences
        cparams.n_outputs_max = max(self.max_rows, self.sequences)
        cparams.kv_unified = True  # a tree's tokens belong to several sequences
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.type_k = cparams.type_v = KV_TYPES[kv_type]
        cparams.no_perf = True
        if self._on_node is not None:
            cparams.cb_eval = self._on_node
            cparams.cb_eval_user_data = None
        return cparams

    # --- what the engine reads of a target ------------------------------------------------

    @property
    def context_length(self) -> int:
        """Tokens a conversation may hold: the model's trained window, within the cache."""
        return min(int(self.lib.llama_model_n_ctx_train(self.model)), self.cache.ledger.capacity - 64)

    def special_ids(self) -> tuple[int | None, set[int]]:
        """(BOS, every end-of-generation id) from the file's vocabulary, asked once: a call a
        token (0.26 s for 49152 tokens, ~0.7 s for Llama-3's 128256), which the load asks of
        its cut while the model itself is still loading (llama_load._check_cut)."""
        if self._special is None:
            lib, vocab = self.lib, self.vocab
            bos = int(lib.llama_vocab_bos(vocab))
            eog = {t for t in (int(lib.llama_vocab_eos(vocab)), int(lib.llama_vocab_eot(vocab))) if t >= 0}
            eog |= {t for t in range(self.vocab_size) if lib.llama_vocab_is_eog(vocab, t)}
            self._special = ((bos if bos >= 0 else None), eog)
        return self._special[0], set(self._special[1])

    def same_vocabulary_as(self, other: LlamaTarget) -> None:
        """Take `other`'s answers about the vocabulary (special_ids): a cut of this file holds
        its vocabulary byte for byte (llama_check_model.py)."""
        if other._special is not None:
            self._special = other._special

    def bytes_streamed(self) -> int:
        return self.streamer.bytes_streamed if self.streamer is not None else 0

    def weight_bytes(self) -> int:
        return int(self.lib.llama_model_size(self.model))

    def kv_bytes_per_token(self) -> int:
        kv = self.buffers.get("KV", 0)
        return kv // max(self.cache.ledger.capacity, 1)

    # --- slots ----------------------------------------------------------------------

    def fresh_slot_state(self) -> dict:
        return {"_seq": None, "cached": []}

    def release_slot_state(self, state: dict) -> None:
        seq = state.get("_seq")
        if seq is not None:
            self.cache.release(seq)
            self._free_seqs.append(seq)
            self._free_seqs.sort(reverse=True)

    @property
    def seq(self) -> int:
        """The slot's own sequence: the cells of its committed tokens."""
        if self._seq is None:
            if not self._free_seqs:
                raise RuntimeError("every sequence id of the target's context is taken")
            self._seq = self._free_seqs.pop()
        return self._seq

    def reset(self) -> None:
        self._settle()
        if self._seq is not None:
            self.cache.release(self._seq)
        self.cached = []

    def forget_beyond(self, context: list[int]) -> None:
        """Nothing to forget: a decoded token's cache entries are the bits a prompt read
        of it writes (every row is row-invariant here), so they stay, and a chat's next
        turn reads only its new tokens."""

    def missing_prompt(self, context: list[int]) -> list[int]:
        self._settle()
        self._borrow_prefix(context[:-1])
        keep = common_prefix_len(self.cached, context[:-1])
        self._truncate(keep)
        return list(context[keep:-1])

    def prefill(self, context: list[int]) -> None:
        todo = self.missing_prompt(context)
        if todo:
            self.verify_batch([], [PromptChunk(self.slot, todo)])

    def verify(self, context: list[int], tree: TokenTree) -> torch.Tensor:
        return self.verify_batch([SlotTree(self.slot, context, tree)])[0]

    # --- the pass ------------------------------------------------------------------------

    def verify_batch(self, trees: Sequence[SlotTree], chunks: Sequence[PromptChunk] = ()) -> list[torch.Tensor]:
        """Every request's tree and every prompt chunk in one pass (llama_decode calls of at
        most `max_rows` rows). Trees whose leaves together need more sequence ids than are
        free verify after it, one pass each, keeping no cell: their accepted tokens are
        read again with the request's next tree. Leaves the last tree's slot in use."""
        self._settle()
        together, after = self._fit(trees)
        out: dict[int, torch.Tensor] = {}
        self._pass(trees, together, chunks, out)
        for i in after:
            self._pass(trees, [i], (), out, keep=False)
            self.trees_apart += 1
        return [out[i] for i in range(len(trees))]

    def _fit(self, trees: Sequence[SlotTree]) -> tuple[list[int], list[int]]:
        """The trees that share the pass (a prefix of them whose leaves fit the free
        sequence ids, leaving room for the largest of the rest) and the rest."""
        leaves = [sum(1 for n in range(len(t.tree)) if not t.tree.children[n]) for t in trees]
        room = len(self._free_seqs) - sum(1 for t in trees if self._parked_seq(t.slot) is None)
        if max(leaves, default=0) > room:
            raise RuntimeError(f"a tree of {max(leaves)} leaves needs more sequence ids than the target has "
                               f"free ({room}): lower the tree budget or raise `sequences`")
        k = len(trees)
        while sum(leaves[:k]) + max(leaves[k:], default=0) > room:
            k -= 1
        return list(range(k)), list(range(k, len(trees)))

    def _parked_seq(self, slot: int) -> int | None:
        if slot == self.slot:
            return self._seq
        return self.__dict__.get("_parked", {}).get(slot, {}).get("_seq")

    def _pass(self, trees: Sequence[SlotTree], which: list[int], chunks: Sequence[PromptChunk],
              out: dict[int, torch.Tensor], *, keep: bool = True) -> None:
        """One pass over `which` of `trees` and `chunks`: rows that stay (prompt chunks, a
        request's catch-up) first, then each tree best branch first, so that when the
        accepted path is that branch the rejected cells are the cache's top ones and are
        freed at once. Each tree's logits land in `out` by its index; `keep=False`: its
        cells are dropped at once (see verify_batch)."""
        rows: list[Row] = []
        kept_chunks = []
        for chunk in chunks:
            self.use_slot(chunk.slot)
            base = len(self.cached) + sum(len(t) for s, t in kept_chunks if s == chunk.slot)
            rows += [Row(t, base + i, (self.seq,), False) for i, t in enumerate(chunk.tokens)]
            kept_chunks.append((chunk.slot, list(chunk.tokens)))
        laid: list[tuple[int, TreeLayout, list[int], list[Row], list[int]]] = []
        for i in which:
            item = trees[i]
            self.use_slot(item.slot)
            self._borrow_prefix(item.context[:-1])
            start = common_prefix_len(self.cached, item.context[:-1])
            self._truncate(start)
            catch = list(item.context[start:-1])
            layout, order, node_seqs = lay_out(item.tree, len(item.context) - 1, self._free_seqs)
            layout.kept = keep
            seq = self.seq
            for leaf in layout.seqs:
                self.cache.cp(seq, leaf, mirror=False)  # the tree sees the prefix (ledger: module docstring)
            rows += [Row(t, start + k, (seq, *layout.seqs), False) for k, t in enumerate(catch)]
            tree = [Row(item.tree.tokens[n], layout.base + item.tree.depths[n], node_seqs[n], True) for n in order]
            laid.append((i, layout, order, tree, catch))
        first_tree_row = len(rows)
        for _, _, _, tree, _ in laid:
            rows += tree
        if self.cache.ledger.free < len(rows) + 1:
            self.cache.compact()
            if self.cache.ledger.free < len(rows) + 1:
                raise ContextOverflowError(
                    f"The target's cache ({self.cache.ledger.capacity} tokens) cannot hold this pass's {len(rows)} rows "
                    f"beside what its requests hold: fewer requests at once, or a larger context (n_ctx).")
        start = time.perf_counter()
        logits, cells = self.calls.run(rows)
        if len(self.first_passes) < 16 and not self.new_shapes_cost_more:
            self.first_passes.append((len(rows) - 1, time.perf_counter() - start))
        self.passes += 1
        for slot, tokens in kept_chunks:
            self.use_slot(slot)
            self.cached += tokens
        row, out_row = first_tree_row, 0
        for i, layout, order, tree, catch in laid:
            self.use_slot(trees[i].slot)
            self.cached += catch
            layout.cells = [0] * len(order)
            per_node = np.empty((len(order), self.vocab_size), dtype=np.float32)
            for k, node in enumerate(order):
                layout.cells[node] = cells[row + k]
                per_node[node] = logits[out_row + k]
            row += len(order)
            out_row += len(order)
            if not keep:
                self._drop_tree(layout, keep=set())
            self._pending[trees[i].slot] = layout
            out[i] = torch.from_numpy(per_node)

    def commit(self, tree: TokenTree, path: list[int]) -> None:
        """Keep the prefix and the accepted path (root first): the request's sequence joins
        the path's cells; the other nodes' cells are freed where they are the cache's top
        cells, else left as garbage (llama_cells.py)."""
        layout = self._pending.pop(self.slot)
        if not layout.kept:  # verified in a pass of its own, its cells dropped: read again next pass
            return
        leaf = layout.leaf_seq[path[-1]]
        self.cache.cp(leaf, self.seq, layout.base, layout.base + len(path))
        self.cached += [tree.tokens[n] for n in path]
        self._drop_tree(layout, keep={layout.cells[n] for n in path})

    # --- inside ----------------------------------------------------------------------

    def _drop_tree(self, layout: TreeLayout, keep: set[int]) -> None:
        """Drop a tree's leaf sequences; its cells outside `keep` become free or garbage."""
        self.cache.drop([c for c in layout.cells if c not in keep], layout.seqs, layout.base)
        self._free_seqs += layout.seqs
        self._free_seqs.sort(reverse=True)

    def _truncate(self, keep: int) -> None:
        if keep < len(self.cached):
            self.cache.release(self.seq, keep)
            del self.cached[keep:]

    def _borrow_prefix(self, prompt: list[int]) -> None:
        """Take into the slot's sequence the longest prefix of `prompt` another slot holds,
        where it is longer than what this slot holds: a cell joins the sequence, nothing is
        computed. If the slot's own cells would then not precede the borrowed ones (a
        sequence's cells must stay in position order), the slot borrows the whole prefix."""
        own = common_prefix_len(self.cached, prompt)
        if own == len(prompt):
            return
        best, donor = own, None
        for state in self.parked_states():
            if state["_seq"] is None:
                continue
            lent = common_prefix_len(state["cached"], prompt)
            if lent > best:
                best, donor = lent, state["_seq"]
        if donor is None:
            return
        mine = self.cache.ledger.cells_of(self.seq)[:own]
        theirs = [c for c in self.cache.ledger.cells_of(donor) if own <= self.cache.ledger.pos[c] < best]
        start = own if not mine or max(mine) < min(theirs) else 0
        self._truncate(start)
        self.cache.cp(donor, self.seq, start, best)
        self.cached = list(prompt[:best])

    def _settle(self) -> None:
        """Before the cache changes again: a tree nobody committed (an error between the pass
        and its commit) is dropped whole; garbage beyond a quarter of the cache is compacted."""
        for slot in list(self._pending):
            layout = self._pending.pop(slot)
            if layout.kept:
                self._drop_tree(layout, keep=set())
        if self.cache.garbage() > max(256, self.cache.ledger.capacity // 4):
            self.cache.compact()

    def close(self) -> None:
        lib = getattr(self, "lib", None)
        if lib is None:
            return
        if self.batch is not None:
            lib.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            lib.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            lib.llama_model_free(self.model)
            self.model = None
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass
