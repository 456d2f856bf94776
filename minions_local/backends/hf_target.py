"""The target: scores a whole voted tree in one forward pass.

Its cache holds every committed token but the last (the root). `verify` runs the
root and the draft nodes together; `commit` keeps the prefix plus the accepted
path's entries and drops the rejected branches. Whether the layers are resident or
streamed from RAM or disk is a property of the model object it wraps.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from minions_local.core.errors import ModelLoadError
from minions_local.core.tree import TokenTree
from minions_local.backends.compact import CompactModel, supports
from minions_local.backends.compact_streamed import StreamedCompactDecoder
from minions_local.backends.hf import CachedModel, context_length
from minions_local.core.protocols import PromptChunk, SlotTree, common_prefix_len
from minions_local.offload.binding import layer_weights, uses_int4_kernel


class HFTarget(CachedModel):
    SLOT_FIELDS = ("_prefix_len", "_features", "_tree_features")

    def __init__(self, model, bytes_streamed: Callable[[], int] | None = None) -> None:
        super().__init__(model)
        # The compact forward keeps its hidden states for free; transformers' would keep
        # every layer's on every pass, so there only a feature drafter turns it on.
        self.keep_hidden = isinstance(self, CompactModel)
        self._bytes_streamed = bytes_streamed or (lambda: 0)
        self._prefix_len = 0
        self._features = torch.empty(0)
        """The final normed hidden state at each committed cache entry, in cache order:
        what the head read there. A feature drafter (backends/eagle.py) drafts from it."""
        self._tree_features: torch.Tensor | None = None

    def fresh_slot_state(self) -> dict:
        return super().fresh_slot_state() | {"_prefix_len": 0, "_features": torch.empty(0), "_tree_features": None}

    shares_passes = False
    """Whether `verify_batch` runs several requests' trees in one pass (the compact
    forward); transformers' forward verifies them one pass each."""

    def missing_prompt(self, context: list[int]) -> list[int]:
        return self.sync(context[:-1])

    def verify_batch(self, trees: Sequence[SlotTree], chunks: Sequence[PromptChunk] = ()) -> list[torch.Tensor]:
        """Each request's tree, verified on its own slot's cache: logits [T_i, V] per
        tree, as `verify` would give them alone; each prompt chunk is appended to its
        slot's cache. Here one pass each; leaves the last request's slot in use."""
        for chunk in chunks:
            self.use_slot(chunk.slot)
            self.prefill(self.cached + chunk.tokens + [0])  # everything but a (placeholder) root
        out = []
        for item in trees:
            self.use_slot(item.slot)
            out.append(self.verify(item.context, item.tree))
        return out

    @property
    def context_length(self) -> int:
        """Tokens a conversation may hold (the model's position limit)."""
        return context_length(self.model.config)

    def special_ids(self) -> tuple[int | None, set[int]]:
        """(BOS, the end-of-sequence ids) as the model's config and generation config say."""
        eos: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            ids = getattr(source, "eos_token_id", None)
            eos.update([ids] if isinstance(ids, int) else list(ids or []))
        bos = getattr(self.model.config, "bos_token_id", None)
        return (bos if isinstance(bos, int) and not isinstance(bos, bool) else None), eos

    def features_of(self, tokens: list[int]) -> torch.Tensor:
        """Features [m, d] of the longest prefix of `tokens` in this target's cache."""
        m = common_prefix_len(self.cached, tokens)
        return self._features[:m]

    def bytes_streamed(self) -> int:
        """Cumulative weight bytes moved into compute memory so far."""
        return self._bytes_streamed()

    def prefill(self, context: list[int]) -> None:
        """Bring the cache to context[:-1], reusing the longest cached prefix."""
        todo = self.sync(context[:-1])
        kept = len(self.cached)
        self.extend(todo)
        self._keep_features(kept, self.last_hidden if todo and self.keep_hidden else None)

    def forget_beyond(self, context: list[int]) -> None:
        self.sync(context[:-1])

    def verify(self, context: list[int], tree: TokenTree) -> torch.Tensor:
        """Logits [T, V] after each tree node (row 0: after the root)."""
        self.prefill(context)
        self._prefix_len = self.cache_len
        logits = self.forward(tree.tokens, tree.ancestor_matrix(), tree.depths, self._prefix_len)
        self._tree_features = self.last_hidden if self.keep_hidden else None
        return logits

    def commit(self, tree: TokenTree, path: list[int]) -> None:
        """Keep the prefix and the accepted path (root first) in the cache."""
        p = self._prefix_len
        if path == list(range(len(path))):
            self.truncate(p + len(path))  # a prefix of the packing order (always so for a chain)
        else:
            self.keep_entries(list(range(p)) + [p + i for i in path])
        self.cached.extend(tree.tokens[i] for i in path)
        self._keep_features(p, None if self._tree_features is None else self._tree_features[path])

    def _keep_features(self, keep: int, new: torch.Tensor | None) -> None:
        """The first `keep` entries' features, then `new` ones. Features are held as a
        prefix without gaps: where some entries before `keep` have none (passes run
        before a feature drafter turned them on), the new ones have no place."""
        if len(self._features) < keep:
            return
        parts = [t for t in (self._features[:keep], new) if t is not None and t.numel()]
        self._features = torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else torch.empty(0))


class SharedPassTarget(CompactModel, HFTarget):
    """A target on the compact forward: several requests' trees share one pass.

    A prompt's cache entries are the same bits however it was chunked (row-invariant
    forward: tiled_attention.py), so a prefix read for one request is exactly what
    another request whose prompt starts the same way would read: a slot reading a
    prompt first copies the longest such prefix any other slot holds (every chat shares
    its template's system prompt). Only prompt entries are lent, never decoded ones
    (a tree pass's rows are not a prompt read's bits): `_prompt_entries` counts the
    leading entries of a slot that a prompt read wrote."""

    shares_passes = True
    SLOT_FIELDS = ("_prompt_entries",)
    _prompt_entries = 0

    def fresh_slot_state(self) -> dict:
        return super().fresh_slot_state() | {"_prompt_entries": 0}

    def missing_prompt(self, context: list[int]) -> list[int]:
        self._borrow_prefix(context[:-1])
        return super().missing_prompt(context)

    def prefill(self, context: list[int]) -> None:
        self._borrow_prefix(context[:-1])
        super().prefill(context)

    def extend(self, tokens: list[int], chunk: int = 512) -> torch.Tensor | None:
        kept = self.cache_len
        logits = super().extend(tokens, chunk)
        self._read_as_prompt(kept)
        return logits

    def _read_as_prompt(self, kept: int) -> None:
        """The slot's cache grew past its first `kept` entries by a prompt read: the new
        entries are prompt entries too where every entry before them is."""
        if self._prompt_entries == kept:
            self._prompt_entries = self.cache_len

    def truncate(self, keep: int) -> None:
        super().truncate(keep)
        self._prompt_entries = min(self._prompt_entries, keep)

    def reset(self) -> None:
        super().reset()
        self._prompt_entries = 0

    def _borrow_prefix(self, prompt: list[int]) -> None:
        """Copy into the current slot the longest prefix of `prompt` that another slot
        holds as prompt entries, where it is longer than what this slot holds (and
        this slot's own are prompt entries too)."""
        own = common_prefix_len(self.cached, prompt)
        if not self.decoder.row_invariant or own == len(prompt) or own > self._prompt_entries:
            return
        best, donor = own, None
        for state in self.parked_states():
            lent = min(common_prefix_len(state["cached"], prompt), state["_prompt_entries"])
            if lent > best:
                best, donor = lent, state
        if donor is None:
            return
        self.truncate(own)
        self.decoder.copy_entries(donor["kv_slot"], own, best)
        self.cached.extend(prompt[own:best])
        self._prompt_entries = best
        features = donor["_features"]
        self._keep_features(own, features[own:best] if len(features) >= best else None)

    def verify_batch(self, trees: Sequence[SlotTree], chunks: Sequence[PromptChunk] = ()) -> list[torch.Tensor]:
        """One pass for every request's tree and every prompt chunk: the weights (a
        streamed target's reads) once over all rows, attention per request over its own
        slot (compact.py forward_parts). A chunk's rows are a prompt's (only its last
        row's logits, computed and dropped); a slot whose cache is behind its context
        catches up first, in passes of its own."""
        if len(trees) == 1 and not chunks:
            return super().verify_batch(trees)
        parts = []
        for item in trees:
            self.use_slot(item.slot)
            self.prefill(item.context)
            self._prefix_len = self.cache_len
            tree = item.tree
            parts.append(self.pass_part(tree.tokens, tree.ancestor_matrix(), tree.depths, self._prefix_len))
        for chunk in chunks:
            self.use_slot(chunk.slot)
            n = len(chunk.tokens)
            part = self.pass_part(chunk.tokens, np.tril(np.ones((n, n), dtype=bool)), list(range(n)), self.cache_len)
            part.prefill = True
            parts.append(part)
        logits = self.decoder.forward_parts(parts)
        for item, part in zip(trees, parts):
            self.use_slot(item.slot)
            self._tree_features = part.hidden if self.keep_hidden else None
        for chunk, part in zip(chunks, parts[len(trees):]):
            self.use_slot(chunk.slot)
            kept = len(self.cached)
            self._read_as_prompt(kept)
            self.cached.extend(chunk.tokens)
            self._keep_features(kept, part.hidden if self.keep_hidden else None)
        return logits[:len(trees)]


class CompactTarget(SharedPassTarget):
    """A resident target on the compact forward (fused, prepacked matmuls): 1.4-1.9x
    faster passes on a CPU. Only used where its logits equal transformers' bit for
    bit on this machine (`exact_target` checks), so decoding stays token-identical."""


class StreamedCompactTarget(SharedPassTarget):
    """A streamed target on the compact forward (fused matmuls over the layer buffers,
    no transformers modules per layer); used where its logits equal transformers'."""

    decoder_class = StreamedCompactDecoder


def exact_target(model, *, bytes_streamed: Callable[[], int] | None = None,
                 release_weights: bool = True) -> HFTarget:
    """The fastest wrapper of `model` that decodes exactly as the target alone does.

    That is the compact forward (streamed where the model's layers stream, as after
    `load_streamed_causal_lm`) where a check at load time finds it exact on this
    machine, else transformers' forward. No forward is exact in the sense of matching
    transformers bit for bit at every row count (transformers' own logits change with
    how many tokens share a pass, in float32 too: MKL's matmuls), so exact means
    row-invariant, in every dtype: each tree row equals the compact forward's own
    1-token pass, bit for bit (float64 attention, oneDNN's matmuls), a prompt's cache
    entries are the same bits however it is chunked, and the logits stay close to
    transformers'. For a streamed model the check runs a few streamed passes: both
    forwards take their layers from the same prefetch pipeline.

    bytes_streamed: the streamer's cumulative byte count (None: nothing streams).
    release_weights: drop the transformers modules' copies of what the compact forward
    holds itself (see CompactDecoder.release_module_weights); the model object can then
    no longer run on its own (the loader owns it, so it may). While it loads, those
    copies sit next to the model's own (peak memory twice the resident weights)."""
    if uses_int4_kernel(model):
        return _int4_target(model, bytes_streamed, release_weights)
    if supports(model) and next(model.parameters()).device.type == "cpu":
        streams = any(layer_weights(layer) is not None for layer in model.model.layers)
        compact = (StreamedCompactTarget if streams else CompactTarget)(model, bytes_streamed=bytes_streamed,
                                                                        row_invariant=True)
        reference, vocab = HFTarget(model), int(model.config.vocab_size)
        if _row_invariant(reference, compact, vocab):
            compact.reset()  # the check's tokens are not the conversation's
            if release_weights:
                compact.decoder.release_module_weights(model)
            return compact
    return HFTarget(model, bytes_streamed=bytes_streamed)


def _int4_target(model, bytes_streamed: Callable[[], int] | None, release_weights: bool) -> HFTarget:
    """A GGUF target whose 4-bit weights the int4 kernel multiplies as they are
    (offload/gguf_int4.py). Only the compact forward runs it, so there is no
    transformers forward to compare with; it must decode exactly as itself alone.

    Each matmul rounds its input to bfloat16, so a row must reach it with the bits it
    has in its own 1-token pass, or a rounding flips and grows: attention runs in
    float64 (row_invariant) and the kernel is row-invariant. The check: every tree
    row's final hidden state equals its 1-token pass's, bit for bit. The head after
    it is one float32 matmul, row-invariant only up to float32 rounding, as in any
    float32 target (a tied 49k-token head is not prepacked: no copy of the embedding)."""
    compact = StreamedCompactTarget(model, bytes_streamed=bytes_streamed, row_invariant=True)
    compact.decoder.head_varies = model.dtype == torch.float32
    prompt, tree = _probe(int(model.config.vocab_size))
    compact.verify(prompt, tree)
    rows, whole = compact.decoder.last_hidden.clone(), prompt_entries(compact, len(prompt) - 1)
    deepest = max(range(len(tree)), key=lambda n: tree.depths[n])
    if (path_rows_differing(compact, prompt, tree, rows, deepest, hidden=True)
            or chunking_differs(compact, prompt[:-1], whole)):
        raise ModelLoadError("The int4 kernel does not give a tree's rows the bits of 1-token passes (or a "
                             "prompt's rows the same bits in any chunking) on this machine, so trees or "
                             "cached prompts would change the replies. Set gguf_kernel = "
                             "'dequant' under [target] in the profile to compute the GGUF's weights in float32.")
    if release_weights:
        compact.decoder.release_module_weights(model)
    return compact


def _probe(vocab: int) -> tuple[list[int], TokenTree]:
    """A random prompt and a branching tree below it: matmul kernels pick their
    blocking by shape, so the check's shapes vary."""
    g = torch.Generator().manual_seed(0)

    def token() -> int:
        return int(torch.randint(0, vocab, (1,), generator=g))

    prompt = [token() for _ in range(24)]
    tree = TokenTree.from_root(prompt[-1])
    for _ in range(15):
        tree.add(int(torch.randint(0, len(tree), (1,), generator=g)), token())
    return prompt, tree


def _row_invariant(reference: HFTarget, compact: HFTarget, vocab: int) -> bool:
    """The tree's rows on the deepest path equal the compact forward's own 1-token
    passes down that path, bit for bit; and the tree's logits are transformers' within
    what bf16 rounding explains (a wrong forward is off by the logits' whole scale)."""
    prompt, tree = _probe(vocab)
    rows = compact.verify(prompt, tree)
    whole = prompt_entries(compact, len(prompt) - 1)  # the tree pass's prefix, read in one chunk
    theirs = reference.verify(prompt, tree)
    if not (rows - theirs).abs().max() <= 0.05 * theirs.abs().max() + 1e-3:
        return False
    deepest = max(range(len(tree)), key=lambda n: tree.depths[n])
    return not path_rows_differing(compact, prompt, tree, rows, deepest) and not chunking_differs(compact, prompt[:-1],
                                                                                                  whole)


def prompt_entries(target: HFTarget, n: int) -> torch.Tensor:
    """A copy of the first n cache entries of `target`'s slot in use (every layer)."""
    return target.decoder.slot_kv.kv[:, :, :, :n].clone()


def chunking_differs(target: HFTarget, prompt: list[int], whole: torch.Tensor) -> bool:
    """Whether a prompt's cache entries change with how it is chunked (tiled_attention.py's
    promise, checked on this machine): `whole` holds them read in one chunk; here the
    prompt is read again as a 1-token chunk (the matmuls' single-row path) and the rest
    (a chunk that starts off its tile's grid), and compared bit for bit. Two passes: at
    8B size a pass costs seconds of the load. Leaves `target`'s cache reset."""
    target.reset()
    target.extend(prompt[:1])
    target.extend(prompt[1:])
    differs = not torch.equal(prompt_entries(target, len(prompt)), whole)
    target.reset()
    return differs


def path_rows_differing(target: HFTarget, context: list[int], tree: TokenTree, rows: torch.Tensor,
                        node: int, *, hidden: bool = False) -> list[int]:
    """The nodes on the path root -> `node` whose tree row (`rows`: the pass over `tree`
    below context[-1]) differs from the 1-token pass autoregressive decoding runs after
    the same tokens, bit for bit. Leaves `target`'s cache reset.

    hidden: `rows` are the tree pass's final hidden states (a compact target's
    `decoder.last_hidden`), compared with each 1-token pass's, not its logits."""
    path = [node]
    while path[-1] != 0:
        path.append(tree.parents[path[-1]])
    path.reverse()  # the root (context[-1]), then the path's nodes
    target.reset()
    ids = list(context[:-1])
    differing = []
    for n in path:
        ids.append(tree.tokens[n])
        step = TokenTree.from_root(ids[-1])
        logits = target.verify(ids, step)
        if not torch.equal(target.decoder.last_hidden[-1] if hidden else logits[0], rows[n]):
            differing.append(n)
        target.commit(step, [0])
    target.reset()
    return differing
