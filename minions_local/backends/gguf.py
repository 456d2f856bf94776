"""A GGUF minion: a small model run by llama.cpp (through llama-cpp-python's C API).

Why the low-level API: the high-level `Llama` object keeps one linear sequence, so a
tree would cost one evaluation (plus a KV rollback) per branch. llama.cpp's KV cache
instead tags every cell with a set of sequence ids and lets a token attend only to
cells of its own sequence, which is exactly a tree mask:

  * the committed prefix lives in one sequence (0 for a minion serving one request);
  * each expanded tree node n gets its own sequence s(n). Before n runs,
    `seq_cp(s(parent), s(n))` adds s(n) to every cell of the parent's path (prefix,
    ancestors, parent), so n sees its path and nothing else;
  * a whole frontier (`budget.width` nodes) then runs in ONE `llama_decode` batch.

After verification the accepted path is kept without re-running it: every other
branch's sequence is removed, and the deepest accepted node's sequence is copied into
the prefix's. Any other context (rollback, a new chat turn) keeps the longest common
prefix of the prefix sequence and runs the rest. The KV cache must be *unified* (one buffer
for all sequences), or llama.cpp would give each sequence its own slice and copy.

Growing ahead (speculation/ahead.py): while the target verifies, the same frontier
goes on growing below the step's tree. If the accepted path ends on a node that ran
(the bonus token included), commit() folds that path into the prefix and keeps the
sequences below it: the next grow starts from that subtree and its waiting
candidates, as if it had grown them itself.

When the target samples, each node's children are drawn from the minion's own
distribution under the request's settings (backends/frontier.drawn_children), as the
transformers minions draw theirs: a draft drawn from a law close to the target's is
accepted far more often than the minion's top token. On cpu-demo-disk with the
q3_k_m substitute, T=0.7, 7 chat prompts x 96 tokens, drawn against top tokens,
interleaved, four runs: 3.41-3.83 -> 3.65-4.53 tokens per pass, 1.05-1.29x tok/s (mean
1.17x). Such a tree is not grown ahead: its draws belong to its step.

Requests (core/slots.py): each slot owns a block of sequence ids in a llama.cpp
context on the one loaded model (backends/llama_context.py), so every sequence, KV
cell and logits row above belongs to one request, and a request's trees are what
they would be alone. By default each request has a context of its own, which is not
free (`slot_bytes`): 236 MiB for the default substitute, most of it the logits rows
and the compute buffer sized for 256 sequences and 512-token prompt chunks, and
~0.2 s to make. Requests sharing a context (`expect_requests`; slot 0, the conversation,
keeps its own) pay those once, and `grow_batch` runs one pass per tree level for all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minions_local.core.errors import MemoryPlanError, ModelLoadError, VocabularyMismatchError
from minions_local.core.minion import BaseMinion
from minions_local.core.protocols import AheadWindow, CandidateTree, GrowBudget
from minions_local.core.slots import SlotStates
from minions_local.backends.frontier import Frontier, drawn_children, top_children
from minions_local.backends.gguf_request import RequestTree
from minions_local.backends.llama_context import (KV_TYPES, MAX_SEQUENCES, LlamaContext, buffer_report,
                                                  context_params, import_llama_cpp, load_model_file, runs_per_block)
from minions_local.backends.llama_early import claim_early_minion

_MAX_GROW_THREADS = 8  # a small minion gains little from more, and each adds a barrier party


class GGUFMinion(SlotStates, BaseMinion):
    """A minion backed by a .gguf file.

    Keyword arguments:
        name: shown in stats (default: the file name without .gguf).
        n_ctx: KV cache size in tokens (prefix + one tree), per request (slot).
        n_batch: most tokens per llama_decode call (longer prompts are chunked).
        n_threads: CPU threads (default: half the cores). llama.cpp's workers spin while
            they wait, so more threads than idle cores is far slower, not faster
            (measured on 2 busy cores: 1 thread 6 ms per tree, 2 threads 140 ms).
            Growing ahead (beside the target's pass) always uses these.
        grow_threads: CPU threads in grow(), while the target waits for the tree
            (default: every core, at most 8). On 2 cores, SmolLM2 q3_k_m: 8 tokens in
            34 ms against 62 on one thread, and the disk-tier engine 2.07x/2.14x
            autoregressive (greedy/sampled) against 1.78x/1.79x with one (bench.py
            --quick, no peers). llama.cpp's OpenMP workers meet at a barrier after
            every op: under OMP_WAIT_POLICY=PASSIVE each barrier is a futex sleep and
            wake, and 2 threads run a token in 33 ms against 18 on one. bench.py once
            set PASSIVE, which is why 2 threads had looked slower there.
        kv_type: "f16" (default, llama.cpp's own) or "f32" (bit-for-bit checks).
        n_gpu_layers: layers offloaded by a CUDA/Metal build of llama.cpp (0 = CPU).
        tree_runs: most tree nodes run per grow (<= 255, one llama.cpp sequence each).
            llama.cpp keeps a vocabulary-sized logits row per sequence: 255 rows of a
            150k vocabulary are 150 MB, so lower it for large vocabularies.
        requests_per_context: requests (slots) that share one llama.cpp context, and so
            its passes in grow_batch (default 1: a context per request). The 256
            sequence ids are split between them, so each runs at most 256 // this - 1
            tree nodes per grow; the KV cache holds n_ctx tokens for each. The surer gain
            is memory: the default substitute holds 3 requests in 416 MiB, against 708
            in contexts of their own. One pass of 3 requests' rows took 1.1-1.4x less
            CPU than three passes (widths 1-8, one thread, 2-core AVX2 EPYC at load 6):
            rows are nearly as dear as tokens there, quantized matmuls being compute-bound.
    """

    depth_is_free = False  # a deeper tree takes more llama_decode passes
    grows_ahead = True
    grows_batches = True  # the requests of one llama.cpp context share its passes
    SLOT_FIELDS = ("_request",)
    """A request's sequence ids in a llama.cpp context, and what they hold."""

    def __init__(self, path: str | os.PathLike[str], *, name: str | None = None, n_ctx: int = 4096,
                 n_batch: int = 512, n_threads: int | None = None, kv_type: str = "f16",
                 n_gpu_layers: int = 0, tree_runs: int = MAX_SEQUENCES - 1, grow_threads: int | None = None,
                 requests_per_context: int = 1) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ModelLoadError(f"GGUF minion {self.path} does not exist: check the path.")
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(KV_TYPES)}, got {kv_type!r}")
        if not 1 <= requests_per_context <= MAX_SEQUENCES // 2:
            raise ValueError(f"requests_per_context must be 1 to {MAX_SEQUENCES // 2}, got {requests_per_context}")
        self.name = name or self.path.name.removesuffix(".gguf")
        self._lib = lib = import_llama_cpp()
        self._model = None  # so close() works after a failed load
        self._contexts: list[LlamaContext] = []

        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        self._model = load_model_file(lib, self.path, mparams, interleave=False)  # ggml's own layouts
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {self.path}: is it a complete GGUF model file?")
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self._vocab))

        threads = n_threads or max(1, (os.cpu_count() or 2) // 2)
        self.n_threads = threads
        self.grow_threads = grow_threads or max(threads, min(os.cpu_count() or 1, _MAX_GROW_THREADS))
        self.requests_per_context = requests_per_context
        self.requests_per_pass = requests_per_context
        """Requests whose trees one grow_batch pass grows, those of one context: the
        blocks of the contexts made for batch slots (see expect_requests)."""
        self.n_batch = min(n_batch, n_ctx)  # llama.cpp clamps it so for causal models anyway
        self._kv_type, self._tree_runs, self._n_ctx = kv_type, tree_runs, n_ctx
        self.tree_runs = runs_per_block(tree_runs, requests_per_context)
        self._context_buffers: dict[str, int] = {}  # what llama.cpp reported allocating for one context
        try:
            self.__dict__.update(self.fresh_slot_state())  # slot 0's
        except ModelLoadError:
            self.close()
            raise
        self.n_ctx = int(lib.llama_n_ctx(self._request.block.context.ctx)) // requests_per_context
        # Shared by every slot: a pass takes the same time whichever request runs it, and
        # the count is a statistic of the minion.
        self._ahead_pass = 0.0  # seconds a pass takes while growing ahead (a running average)
        self.carries = 0
        """Steps that started from a subtree grown ahead (see commit)."""

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], **kwargs: Any) -> GGUFMinion:
        """The minion at `path`: made early where asked with these options (llama_early.py), else now."""
        return (claim_early_minion(path, kwargs) if cls is GGUFMinion else None) or cls(path, **kwargs)

    # --- the Minion protocol ------------------------------------------------------------

    def grow(self, context: list[int], budget: GrowBudget) -> CandidateTree:
        return self.grow_batch([(self.slot, context, budget)])[0]

    def grow_ahead(self, budget: GrowBudget, window: AheadWindow) -> int:
        """Go on growing the last tree, best first, while the target verifies it: the
        subtree below the token the target ends on is the next step's head start (see
        commit). `budget` bounds the whole tree; a pass starts only if `window` allows
        its expected time. Returns the nodes added."""
        frontier = self._request.frontier
        if frontier is None or frontier.ranked:  # a sampled tree's draws belong to its own step
            return 0
        before = len(frontier.tree)
        frontier.budget = budget
        self._run_levels([self.slot], window)
        return len(frontier.tree) - before

    def commit(self, accepted: list[int]) -> None:
        """Keep the accepted path's KV cells (they ran during grow) and drop the rest,
        except the subtree below the bonus token when it ran too (grown ahead): that
        subtree, cells and waiting candidates included, starts the next step's tree."""
        request = self._request
        if request.carry(accepted):
            self.carries += 1
        else:
            request.keep_tree_path(request.prefix + list(accepted))

    def reset(self) -> None:
        self._request.reset()

    # --- many requests ------------------------------------------------------------------

    def grow_batch(self, requests: Sequence[tuple[int, list[int], GrowBudget]]) -> list[CandidateTree]:
        """Grow several requests' trees, given as (slot, context, budget), one request
        per slot: the requests whose slots share a llama.cpp context share its passes
        (their new prompt tokens in one, then one per tree level with every request's
        next nodes). Each tree is the one grow() would give on its slot alone (a
        shared pass may round its log-probabilities differently, by ~1e-5). The slot
        in use stays."""
        trees: list[CandidateTree | None] = [None] * len(requests)
        growing: dict[LlamaContext, list[int]] = {}
        back = self.slot
        for i, (slot, context, budget) in enumerate(requests):
            self.use_slot(slot)
            if budget.max_nodes <= 0 or budget.max_depth <= 0 or len(context) >= self.n_ctx:
                trees[i] = CandidateTree()  # past this minion's window it abstains; the target decides alone
            else:
                growing.setdefault(self._request.block.context, []).append(i)
        try:
            for llama, members in growing.items():
                with llama.running_on(self.grow_threads):
                    self._start_trees([requests[i] for i in members])
                    self._run_levels([requests[i][0] for i in members])
                for i in members:
                    self.use_slot(requests[i][0])
                    trees[i] = self._request.proposal(requests[i][2])
        finally:
            self.use_slot(back)
        return trees

    SHARED_MOST = 8
    """Most requests in one context: each runs at most 256 // 8 - 1 = 31 tree nodes per
    grow (ample for trees shared 8 ways; more requests go to a second context)."""
    SHARED_CELLS = 8192
    """Most tokens the requests of one shared context may hold between them. Its KV
    cache is one buffer, and llama.cpp's attention spans every request's cells (masked):
    8 requests' 2-node trees at 1500 tokens each took 374 ms in one shared pass against
    370 one after another in contexts of their own, at 3000 tokens 1221 against 628
    (2-core AVX2 EPYC); at chat lengths sharing pays 1.4-1.7x."""

    def expect_requests(self, requests: int, tokens: int | None = None) -> None:
        """`requests` requests of at most `tokens` tokens each (None: not known, as a
        server's) will decode together: the contexts made for slots from now on hold as
        many as SHARED_MOST and SHARED_CELLS allow (unknown lengths: SHARED_MOST, as in
        llama.cpp's server; chats are short, where it pays most: 8 on cpu-demo-disk, 84-98
        tok/s against 21-68 in contexts of 2; a long one slows its mates' grows), for
        grow_batch to run their trees one pass per level for all of them. A shared
        context's KV cache (n_ctx tokens a request) is allocated whole with its first
        request; its logits and compute buffers once."""
        fit = self.SHARED_MOST if tokens is None else self.SHARED_CELLS // max(1, min(tokens, self.n_ctx))
        self.requests_per_pass = max(1, min(requests, self.SHARED_MOST, fit))

    # --- one state per request (core/slots.py) ------------------------------------------

    def fresh_slot_state(self) -> dict[str, Any]:
        """A free block of sequence ids in a context on the loaded model (the weights are
        shared), in a new context when every block is held: one request's tree never
        meets another's."""
        block = next(filter(None, (c.take() for c in self._contexts)), None)
        if block is None:
            block = self._new_context(self.requests_per_pass if self._contexts else self.requests_per_context).take()
        return super().fresh_slot_state() | {"_request": RequestTree(block)}

    def release_slot_state(self, state: dict[str, Any]) -> None:
        """Free the slot's block, and its context once no request holds a block of it."""
        block = state["_request"].block
        llama = block.context
        if llama.blocks == 1:
            llama.close()  # its only block: the cells go with it
        else:
            llama.give_back(block)
            if llama.idle:
                llama.close()
        if llama.ctx is None:
            self._contexts.remove(llama)

    def drop_slot(self, slot: int) -> None:
        """Forget `slot`'s request and free its block (its context once no request holds
        one). The slot in use keeps its block, emptied: a new one would cost what the
        old one frees."""
        if slot == self.slot:
            self.reset()
        else:
            super().drop_slot(slot)

    def slot_bytes(self) -> int:
        """Bytes one more request (slot) costs: a context's KV cache, logits rows and
        compute buffer, as llama.cpp reported them, over the requests it holds. For the
        default q3_k_m SmolLM2 substitute (n_ctx 4096, f16 KV, 256 sequences, 49k
        vocabulary), one request per context: 90 MiB of KV + 48 of logits + 98 of
        compute = 236 MiB."""
        return -(-sum(self._context_buffers.values()) // self.requests_per_context)

    # --- model access -------------------------------------------------------------------

    def prefill(self, context: Sequence[int]) -> np.ndarray:
        """Bring the slot's prefix sequence to `context` (reusing the longest cached
        prefix) and return the logits after its last token, the tree root. On n_threads:
        it may run beside the target's own prefill (speculation/decode.py)."""
        return self._read_prompts([(self.slot, context)])[-1]

    def prefill_batch(self, requests: Sequence[tuple[int, Sequence[int]]]) -> None:
        """`prefill` for several requests, given as (slot, context), while nothing else
        runs: on grow_threads, and the requests sharing a context in one pass. 8 chat
        prompts (462 tokens), q3_k_m substitute, 2-core AVX2 EPYC: 0.90 s against 1.69
        one after another on one thread. The slot in use stays."""
        back, by_context = self.slot, {}
        for slot, context in requests:
            self.use_slot(slot)
            by_context.setdefault(self._request.block.context, []).append((slot, context))
        try:
            for llama, members in by_context.items():
                with llama.running_on(self.grow_threads):
                    self._read_prompts(members)
        finally:
            self.use_slot(back)

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits after every token of `tokens`, computed from scratch ([len, vocab])."""
        self.reset()
        tokens = [int(t) for t in tokens]
        try:
            return self._decode(tokens, list(range(len(tokens))), [self._request.block.first] * len(tokens),
                                [True] * len(tokens))
        finally:
            self.reset()

    def token_texts(self) -> list[str]:
        """Every token's text as stored in the GGUF (byte-level BPE strings, like HF's
        `convert_ids_to_tokens`)."""
        get = self._lib.llama_vocab_get_text
        return [(get(self._vocab, i) or b"").decode("utf-8", "replace") for i in range(self.vocab_size)]

    def check_vocabulary(self, target_vocab_size: int, target_tokens: Sequence[str] | None = None) -> None:
        """Raise VocabularyMismatchError unless this minion's ids mean what the target's do.

        target_tokens: the target tokenizer's id -> token string list, for a full check."""
        problem = None
        if self.vocab_size != target_vocab_size:
            problem = f"it has {self.vocab_size} token ids, the target {target_vocab_size}"
        elif target_tokens is not None:
            mine = self.token_texts()
            diff = [i for i, t in enumerate(target_tokens) if i < len(mine) and mine[i] != t]
            if diff:
                problem = f"{len(diff)} token ids map to different text (first: id {diff[0]})"
        if problem:
            raise VocabularyMismatchError(f"The GGUF minion {self.path} does not share the target's vocabulary: "
                                          f"{problem}. Export it from a model with the target's tokenizer.")

    def close(self) -> None:
        """Free every context (every slot's), then the model."""
        for slot in self.slots_held():
            if slot != self.slot:
                self.drop_slot(slot)
        for llama in self._contexts:
            llama.close()
        self._contexts = []
        if self._model:
            self._lib.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass

    # --- internals ----------------------------------------------------------------------

    def _new_context(self, blocks: int) -> LlamaContext:
        lib, first = self._lib, not self._context_buffers
        cparams = context_params(self._lib, n_ctx=self._n_ctx, blocks=blocks, runs=self._tree_runs,
                                 n_batch=self.n_batch, threads=self.n_threads, kv_type=self._kv_type)
        with buffer_report() as buffers:
            ctx = lib.llama_init_from_model(self._model, cparams)
        if not ctx:
            if first:
                raise ModelLoadError(f"llama.cpp could not create a context for {self.path} "
                                     f"(n_ctx={cparams.n_ctx}): try a smaller n_ctx.")
            raise MemoryPlanError(f"llama.cpp could not create another context for {self.path} "
                                  f"({sum(self._context_buffers.values()) / 2**20:.0f} MiB for "
                                  f"{self.requests_per_context} request(s)). Serve fewer requests at once, or "
                                  f"give the minion a smaller n_ctx.")
        if first:
            self._context_buffers = buffers
        llama = LlamaContext(lib, ctx, blocks=blocks, n_batch=self.n_batch,
                             vocab_size=self.vocab_size, threads=self.n_threads)
        self._contexts.append(llama)
        return llama

    def _prefill_plan(self, context: Sequence[int]) -> list[int]:
        if not context:
            raise ValueError("a minion needs at least one context token (the tree root)")
        if len(context) > self.n_ctx:  # grow() abstains before this happens
            raise ValueError(f"context of {len(context)} tokens exceeds this minion's n_ctx={self.n_ctx}")
        return self._request.prefill_plan(context)

    def _start_trees(self, requests: Sequence[tuple[int, list[int], GrowBudget]]) -> None:
        """Give each request (all in one context) its tree's root: the tree carried over
        from growing ahead, or a new one from its prompt, every prompt's new tokens
        in one pass."""
        fresh = []
        for slot, context, budget in requests:
            self.use_slot(slot)
            request, sampling = self._request, budget.sampling is not None
            frontier = request.frontier
            if frontier is not None and request.prefix == list(context) and not sampling and not frontier.ranked:
                # Grown ahead during the last verification and carried over by commit():
                # the tree below this root is partly grown already, its KV cells in place.
                # (Sampled trees, this one or the carried one, start afresh: their draws
                # come from their own step's generator.)
                frontier.budget = budget
                continue
            fresh.append((slot, budget, context))
        if not fresh:
            return
        roots = self._read_prompts([(slot, context) for slot, _, context in fresh])
        for (slot, budget, _), root_logits in zip(fresh, roots):
            self.use_slot(slot)
            request = self._request
            # Sampled: children are drawn and ranked by draw order, so the tree's shape
            # never depends on what was drawn (frontier.py, accept.py).
            request.frontier = Frontier(CandidateTree(), budget, ranked=budget.sampling is not None)
            request.tree = request.frontier.tree
            self._offer(request.frontier, root_logits[None, :], [-1])

    def _read_prompts(self, requests: Sequence[tuple[int, Sequence[int]]]) -> np.ndarray:
        """Bring each request's (slot, context; all in one context) prefix sequence up
        to its context, every request's new tokens in one pass; the logits after each
        context's last token, its tree root."""
        rows: tuple[list[int], list[int], list[int], list[bool]] = ([], [], [], [])
        pending = []
        for slot, context in requests:
            self.use_slot(slot)
            request, new = self._request, self._prefill_plan(context)
            rows[0].extend(new)
            rows[1].extend(range(len(request.prefix), len(request.prefix) + len(new)))
            rows[2].extend([request.block.first] * len(new))
            rows[3].extend([False] * (len(new) - 1) + [True])
            pending.append(new)
        roots = self._decode(*rows, slots=[slot for slot, _ in requests])
        for (slot, _), new in zip(requests, pending):
            self.use_slot(slot)
            self._request.prefix.extend(new)
        return roots

    def _run_levels(self, slots: list[int], window: AheadWindow | None = None) -> None:
        """Run the best nodes of the slots' trees (all in one context), one pass per
        level holding each tree's next `budget.width` nodes, until every tree is full
        or has nothing worth running, or (growing ahead) `window` closes."""
        # Nodes that did not run before but may now (under a larger budget: ahead, or in
        # the next step) go first: they are in the tree, so they rank above anything
        # waiting. Under one budget a node once skipped stays skipped (Frontier.
        # worth_running), so they are looked for once per call, and a fresh grow finds
        # none: its tree is as before.
        retry = {}
        for slot in slots:
            self.use_slot(slot)
            retry[slot] = self._request.frontier.worth_running(self._request.unrun)
        active = list(slots)
        while active and (window is None or window.allows(self._ahead_pass)):
            rows: tuple[list[int], list[int], list[int]] = ([], [], [])
            passes = []
            for slot in list(active):
                self.use_slot(slot)
                batch, retry[slot] = self._request.next_nodes(retry[slot], self.n_ctx, self.n_batch)
                if batch is None:
                    active.remove(slot)
                elif batch:
                    passes.append((slot, batch))
                    for column, values in zip(rows, self._request.pass_rows(batch)):
                        column.extend(values)
            if not passes:
                continue
            start = time.perf_counter()
            logits = self._decode(*rows, [True] * len(rows[0]), slots=[slot for slot, _ in passes])
            if window is not None:
                self._ahead_pass += 0.25 * (time.perf_counter() - start - self._ahead_pass)
            row = 0
            for slot, batch in passes:
                self.use_slot(slot)
                self._offer(self._request.frontier, logits[row:row + len(batch)], batch)
                row += len(batch)

    @staticmethod
    def _offer(frontier: Frontier, logits: np.ndarray, parents: list[int]) -> None:
        budget = frontier.budget
        if budget.sampling is not None and frontier.ranked:
            rows = torch.from_numpy(logits)
            for row, parent in zip(rows, parents):
                frontier.offer(parent, drawn_children(row, budget, frontier.tree, parent))
            return
        tokens, logprobs = top_children(logits, budget.top_k)
        for row, parent in enumerate(parents):
            frontier.offer(parent, zip(tokens[row].tolist(), logprobs[row].tolist()))

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[int], outputs: list[bool], *,
                slots: list[int] | None = None) -> np.ndarray:
        """Run tokens of the slots' sequences (default: the slot in use) in their shared
        context; the logits of those marked in `outputs`."""
        try:
            return self._request.block.context.decode(tokens, positions, seqs, outputs)
        except RuntimeError as err:
            # The cells the pass wrote may be half-written: those slots start clean.
            back = self.slot
            for slot in slots or [back]:
                self.use_slot(slot)
                self.reset()
            self.use_slot(back)
            raise RuntimeError(f"{err} for {self.path} (n_ctx={self.n_ctx} per request)") from None
