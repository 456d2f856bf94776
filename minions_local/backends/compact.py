"""A compact forward for Llama-family models (Llama, Qwen2, Mistral).

A forward over a handful of tokens spends much of its time, in transformers, on
framework overhead: a dozen module calls per layer, RMSNorm's fp32 round trips, a
cache that re-concatenates itself every pass, and on a CPU a oneDNN reorder of every
weight on every call. Here the same weights run with q/k/v and gate/up fused into one
matmul each, prepacked for oneDNN once (where that is bit-exact), a fused RMSNorm,
and a preallocated KV cache written in place. Rotary embeddings come from the model's
own rotary module, so every RoPE scaling variant stays correct.

Minions always use it where supported (their numerics need not match anyone's: the
target decides what is accepted). A resident target uses it only after a check at
load time that its logits equal transformers' bit for bit (hf_target.exact_target),
so decoding stays token-identical to the target run by transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from minions_local.backends.hf import CachedModel, attention_kernels
from minions_local.backends.packing import (TIED_HEAD_COPY, onednn_linear, pack_weight, packing_is_exact,
                                            row_invariant_matmuls)
from minions_local.backends.tiled_attention import KEY_BLOCK, attend_prompt


@dataclass(eq=False)
class KVSlot:
    """One sequence's keys and values in every layer: kv [layers, 2, kv_heads,
    capacity, head_dim], the first `length` positions filled."""

    kv: torch.Tensor
    length: int = 0


@dataclass(eq=False)
class PassPart:
    """One sequence's share of a pass: its new tokens on top of its own cache."""

    slot: KVSlot
    tokens: list[int]
    mask: torch.Tensor
    """Additive (1, 1, T, slot.length + T): what each new token may see."""
    positions: torch.Tensor
    """[1, T] rotary positions."""
    prefill: bool = False
    """A prompt chunk: only its last row's logits, attention on the fast kernel."""
    hidden: torch.Tensor | None = None
    """Filled by the pass: the final normed hidden states of its rows [T, d]."""


@dataclass(frozen=True)
class _CacheView:
    """A part's cache as one pass reads and writes it, every layer at once: views made
    once a pass, not once a layer (at 16 requests a pass otherwise makes ~4,000 small
    views, ~10% of its time on a 2-core CPU)."""

    new_keys: torch.Tensor
    """[layers, kv_heads, T, head_dim]: where the part's new keys go."""
    new_values: torch.Tensor
    keys: torch.Tensor
    """[layers, 1, kv_heads, length + T, head_dim]: what its attention reads."""
    values: torch.Tensor

    @classmethod
    def of(cls, part: PassPart) -> _CacheView:
        kv, start = part.slot.kv, part.slot.length
        end = start + len(part.tokens)
        return cls(kv[:, 0, :, start:end], kv[:, 1, :, start:end],
                   kv[:, 0, :, :end].unsqueeze(1), kv[:, 1, :, :end].unsqueeze(1))


class CompactDecoder:
    def __init__(self, model, capacity: int = 512, pack: bool = True, exact: bool = True,
                 row_invariant: bool = False) -> None:
        cfg = model.config
        if not supports(model):
            raise ValueError(f"the compact forward does not support this {cfg.model_type} configuration")
        inner = model.model
        self.dtype = inner.embed_tokens.weight.dtype
        self.device = inner.embed_tokens.weight.device
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.norm_w, self.eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head = model.lm_head.weight
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.layers = [self._fuse(layer) for layer in inner.layers]
        self.head_linear = None
        """The lm_head's matmul when it differs from the layers' (None: the same)."""
        self.exact = exact
        """False: fewer, cheaper ops whose rounding differs from transformers (minions)."""
        self.row_invariant = row_invariant
        """Attention in float64 (see _attend): every row of a pass comes out as a 1-token
        pass over the same visible keys would give it, whatever else shares the pass."""
        self.head_varies = False
        """The head need not be row-invariant: nothing is rounded after it (a float32
        head; see hf_target._int4_target), so a 1-token pass skips the doubled row."""
        self.linear = F.linear
        # A row-invariant target multiplies on oneDNN in every dtype: MKL's float32
        # matmul (F.linear's) rounds a row differently at 1, 7 or 16 rows than at 2, 3
        # or 512, oneDNN's only at 1 row (_linear runs that as 2).
        self.onednn = row_invariant and row_invariant_matmuls(self.dtype, self.device)
        if pack and (packing_is_exact(self.dtype, self.device) or self.onednn):
            self._pack()
        elif self.onednn:
            self.linear = self.head_linear = onednn_linear
        self.max_len = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 20)
        self.capacity = min(capacity, self.max_len)
        """Tokens a new slot's cache starts with room for (it doubles as it fills)."""
        self.slot_kv = self.new_slot()
        """The cache of the sequence that `forward` runs on (one per request: core/slots.py)."""
        self.last_hidden: torch.Tensor | None = None
        """The last pass's final normed hidden states [T, d]: what the head read (the
        target's features, which a feature drafter drafts from)."""

    def new_slot(self) -> KVSlot:
        """An empty cache for one more sequence."""
        return KVSlot(self._alloc(self.capacity))

    @property
    def kv(self) -> torch.Tensor:
        return self.slot_kv.kv

    @property
    def length(self) -> int:
        return self.slot_kv.length

    @length.setter
    def length(self, value: int) -> None:
        self.slot_kv.length = value

    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token takes (every layer's key and value)."""
        return 2 * len(self.layers) * self.kv_heads * self.head_dim * self.dtype.itemsize

    def _alloc(self, capacity: int) -> torch.Tensor:
        shape = (len(self.layers), 2, self.kv_heads, capacity, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _reserve(self, slot: KVSlot, needed: int) -> None:
        """Grow a cache by doubling: a long-context minion never preallocates its
        whole window. A row-invariant forward's prompt attention reads whole key blocks
        (tiled_attention.py), so its capacity reaches the next block's end."""
        if self.row_invariant:
            needed = -(-needed // KEY_BLOCK) * KEY_BLOCK
        capacity = slot.kv.shape[3]
        if needed <= capacity:
            return
        while capacity < needed:
            capacity *= 2
        bigger = self._alloc(capacity)
        bigger[:, :, :, :slot.length] = slot.kv[:, :, :, :slot.length]
        slot.kv = bigger

    def _fuse(self, layer) -> dict | None:
        """A layer's weights as this forward holds them (None: they arrive with each pass)."""
        return fused_layer(layer)

    def weight_bytes(self) -> int:
        """Bytes of the weights this forward reads (its own fused/packed copies)."""
        tensors = [self.embed, self.norm_w, self.lm_head]
        tensors += [t for L in self.layers if L for t in L.values() if isinstance(t, torch.Tensor)]
        unique = {id(t): t for t in tensors}.values()  # a tied lm_head is the embedding itself
        return sum(t.numel() * t.element_size() for t in unique)

    def release_module_weights(self, model) -> None:
        """Drop the transformers modules' weights that this forward holds a copy of
        (stacked q/k/v and gate/up, prepacked matmuls, a prepacked untied lm_head), so
        that nothing resident is held twice; weights it uses as they are, and the
        embedding, stay. The module can no longer run its own forward."""
        empty = torch.nn.Parameter(torch.empty(0, dtype=model.dtype), requires_grad=False)
        for layer, fused in zip(model.model.layers, self.layers):
            if fused is None:  # its weights arrive with each pass: nothing held
                continue
            att, mlp = layer.self_attn, layer.mlp
            for lin, key in ((att.q_proj, "qkv"), (att.k_proj, "qkv"), (att.v_proj, "qkv"), (att.o_proj, "o"),
                             (mlp.gate_proj, "gate_up"), (mlp.up_proj, "gate_up"), (mlp.down_proj, "down")):
                if fused[key] is not lin.weight:
                    lin.weight = empty
        head = model.lm_head.weight
        if self.lm_head is not head and head is not model.model.embed_tokens.weight:
            model.lm_head.weight = empty

    def _pack(self) -> None:
        """Reorder every matmul weight once into oneDNN's blocked layout.

        transformers hands oneDNN a plain weight each call, which it reorders again
        every time; prepacked, a CPU matmul of a few rows runs 2-2.5x faster (measured
        on this project's 2-core box, bit-identical results in bf16)."""
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                layer[name] = pack_weight(layer[name])
        self.linear = onednn_linear
        self._pack_head()

    def _pack_head(self) -> None:
        """Prepack the lm_head, unless it is a big tied one: that is the embedding, which
        lookups need plain, and a second copy would cost hundreds of MB."""
        if not packing_is_exact(self.dtype, self.device):
            # Packed only for row invariance (float32): the head keeps the module's plain
            # weight, which a feature drafter shares (models/drafter.py).
            self.head_linear = onednn_linear
        elif self.lm_head is not self.embed or self.lm_head.numel() * self.lm_head.element_size() <= TIED_HEAD_COPY:
            self.lm_head = pack_weight(self.lm_head)
            self.head_linear = onednn_linear
        else:
            self.head_linear = F.linear

    # --- cache edits (same contract as backends.hf.CachedModel) ------------------------

    def truncate(self, keep: int) -> None:
        self.length = min(self.length, keep)

    @torch.inference_mode()  # the cache is an inference tensor: edit it in the same mode
    def keep_entries(self, positions: list[int]) -> None:
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        n = len(positions)
        kv = self.kv
        kv[:, :, :, :n] = kv.index_select(3, index)
        self.length = n

    @torch.inference_mode()
    def copy_entries(self, source: KVSlot, start: int, end: int) -> None:
        """Cache entries start..end of `source` (another sequence's) become the current
        slot's, which held `start` entries: every layer's keys and values."""
        slot = self.slot_kv
        self._reserve(slot, end)
        slot.kv[:, :, :, start:end] = source.kv[:, :, :, start:end]
        slot.length = end

    # --- forward ---------------------------------------------------------------------

    def _layer(self, i: int) -> dict:
        """Layer i's weights for this pass (a streamed forward fetches them here)."""
        return self.layers[i]

    def _done(self, i: int) -> None:
        """Layer i has run in this pass (a streamed forward gives its buffer back here)."""

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not self.exact:  # one op in the model's dtype instead of four
            return F.rms_norm(x, (x.shape[-1],), w, eps=self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(self.dtype) * w

    def _begin_pass(self) -> None:
        """A pass starts (a streamed forward starts its layers' reads here)."""

    def forward(self, tokens: list[int], mask: torch.Tensor, positions: torch.Tensor, *,
                prefill: bool = False) -> torch.Tensor:
        """Logits [T, V] (float32) for T new tokens on the current slot's cache; mask
        (1, 1, T, length + T) additive.

        `prefill`: a chunk of a prompt (a chain on top of the cache). Only its last
        row's logits are computed ([1, V]). Where passes are row-invariant, its attention
        is tiled_attention's, whose rows are the same bits however the prompt is chunked
        and whatever shares the pass (float64 attention, the decoding passes', grows with
        the square of a prompt: SmolLM2, 1500 tokens, 5.4 of 7.0 s). A prompt's entries
        then never depend on its chunking; the engine keeps no decoded entry past a
        reply (Engine, BatchRun), so a cache holds only prompt entries between requests.
        `last_hidden` keeps every row."""
        part = PassPart(self.slot_kv, tokens, mask, positions, prefill)
        logits = self.forward_parts([part])[0]
        self.last_hidden = part.hidden
        return logits

    @torch.inference_mode()
    def forward_parts(self, parts: list[PassPart]) -> list[torch.Tensor]:
        """One pass over several sequences' new tokens (continuous batching): their
        rows are packed with no padding, every matmul (a streamed layer's weights) runs
        once over all of them, and attention runs per part, over that part's own cache
        and mask. Returns each part's logits, as `forward` would alone; each part's
        final hidden states land in `part.hidden`.

        Every row comes out as it would in a pass of its own: norms, RoPE and the MLP
        act row by row, the matmuls do for two or more rows (`_linear`), and attention
        sees only the part's own keys."""
        spans, start = [], 0
        for p in parts:
            self._reserve(p.slot, p.slot.length + len(p.tokens))
            spans.append((start, start + len(p.tokens)))
            start += len(p.tokens)
        t = start
        self._begin_pass()
        ids = torch.tensor([tok for p in parts for tok in p.tokens], dtype=torch.long, device=self.device)
        x = self._inputs(ids)  # [1, T, d]
        positions = parts[0].positions if len(parts) == 1 else torch.cat([p.positions for p in parts], dim=1)
        cos, sin = self.rotary(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, T, hd]
        nq, nkv, hd = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.head_dim
        views = [_CacheView.of(p) for p in parts]
        for i in range(len(self.layers)):
            L = self._layer(i)
            h = self._rms(x, L["ln1"])
            qkv = self._linear(h, L["qkv"], L["qkv_bias"])
            v = qkv[..., nq + nkv:].view(1, t, self.kv_heads, hd).transpose(1, 2)
            if self.exact:
                q = _rope(qkv[..., :nq].view(1, t, self.heads, hd).transpose(1, 2), cos, sin)
                k = _rope(qkv[..., nq:nq + nkv].view(1, t, self.kv_heads, hd).transpose(1, 2), cos, sin)
            else:  # rotate queries and keys in one go: half the small ops
                qk = _rope(qkv[..., :nq + nkv].view(1, t, self.heads + self.kv_heads, hd).transpose(1, 2), cos, sin)
                q, k = qk[:, :self.heads], qk[:, self.heads:]
            att = [self._attend_part(i, p, view, q[:, :, a:b], k[0, :, a:b], v[0, :, a:b])
                   for p, view, (a, b) in zip(parts, views, spans)]
            att = att[0] if len(att) == 1 else torch.cat(att, dim=2)
            x = x + self._linear(att.transpose(1, 2).reshape(1, t, nq), L["o"])
            h = self._rms(x, L["ln2"])
            gate_up = self._linear(h, L["gate_up"])
            x = x + self._linear(F.silu(gate_up[..., :L["inter"]]) * gate_up[..., L["inter"]:], L["down"])
            self._done(i)
        x = self._rms(x, self.norm_w)[0]
        for p, (a, b) in zip(parts, spans):
            p.slot.length += b - a
            p.hidden = x[a:b]
        # The head is a fifth of a prefill's flops on a 49k vocabulary (SmolLM2: 278 ms
        # of a 512-token chunk on 2 cores) and its [T, V] float32 logits 100 MB: a
        # prompt chunk's rows but its last skip it.
        rows = [(b - 1, b) if p.prefill else (a, b) for p, (a, b) in zip(parts, spans)]
        picked = x[rows[0][0]:rows[0][1]] if len(rows) == 1 else torch.cat([x[a:b] for a, b in rows])
        logits = self._linear(picked, self.lm_head, head=True).float()
        return list(logits.split([b - a for a, b in rows]))

    def _attend_part(self, layer: int, part: PassPart, view: _CacheView, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
        """Write one part's new keys and values into its cache and attend over it."""
        view.new_keys[layer].copy_(k)
        view.new_values[layer].copy_(v)
        if self.row_invariant and part.prefill:
            kv = part.slot.kv[layer]
            return attend_prompt(q, kv[0], kv[1], part.slot.length)
        return self._attend(q, view.keys[layer], view.values[layer], part.mask, row_invariant=self.row_invariant)

    def _inputs(self, ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input for these token ids: their embeddings."""
        return F.embedding(ids, self.embed).unsqueeze(0)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                head: bool = False) -> torch.Tensor:
        """x @ weight.T (+ bias). Row invariance: oneDNN runs a single row through
        another kernel than two or more, and on real activations it rounds some rows
        differently (SmolLM2's down projection: 3 of 16 tree rows; every batch of 2 to
        100 rows agreed). So a 1-token pass runs its row twice and keeps one: the same
        kernels as a tree pass, at the cost of a row a memory-bound matmul barely notices."""
        if not isinstance(weight, torch.Tensor):  # the int4 kernel's form, or a stack holding one
            if isinstance(weight, tuple):
                out = torch.cat([self._linear(x, w) for w in weight], dim=-1)
                return out if bias is None else out + bias
            return weight(x, bias)  # row-invariant as it is (gguf_int4.py)
        linear = (self.head_linear or self.linear) if head else self.linear
        if self.row_invariant and x.shape[-2] == 1 and not (head and self.head_varies):
            return linear(torch.cat([x, x], dim=-2), weight, bias).narrow(-2, 0, 1)
        return linear(x, weight, bias)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
                row_invariant: bool) -> torch.Tensor:
        """Masked attention [1, H, T, hd] over the cache.

        Row invariance: a bf16 tree pass must give each row what the 1-token pass of
        autoregressive decoding gives, or a near-tie between the two best tokens flips
        and greedy output drifts from the target's own (measured on SmolLM2, 8 chat
        replies: 1 identical before this). Norms and RoPE act row by row, and the linear
        layers do once a 1-token pass runs as two rows (_linear); attention does not,
        since the rows and masked keys sharing a pass change how a row's terms are summed. In float64 that changes a row by ~1e-16 of
        its size, which rounding back to bf16 (2^-8) erases, so every row comes out as it
        would alone. The cost is small: attention is a few % of a small batch's FLOPs."""
        if not row_invariant:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                 enable_gqa=self.heads != self.kv_heads)
        _, heads, t, hd = q.shape
        kv_heads, length = keys.shape[1], keys.shape[2]
        # Query heads sharing a key/value head (GQA) run as one matmul against it.
        grouped = q.double().reshape(1, kv_heads, heads // kv_heads * t, hd)
        scores = (grouped @ keys.double().transpose(-1, -2)).view(1, heads, t, length)
        probs = torch.softmax(scores * hd ** -0.5 + mask.double(), dim=-1)
        out = probs.view(1, kv_heads, heads // kv_heads * t, length) @ values.double()
        return out.view(1, heads, t, hd).to(q.dtype)


def fused_layer(layer, stack: Callable[[list[torch.Tensor]], torch.Tensor] = torch.cat,
                packed: dict | None = None) -> dict:
    """A decoder layer's weights as the compact forward reads them: q/k/v and gate/up
    each stacked into one matmul weight by `stack` (the streamed forward stacks views
    of its layer buffer instead of copies), the rest as they are. `packed`: weights
    held in the int4 kernel's form, by parameter name (offload/gguf_int4.py); a stack
    holding one is a tuple whose matmuls run one by one (`_linear`)."""
    att, mlp = layer.self_attn, layer.mlp
    packed = packed or {}

    def weight(path: str):
        return packed.get(f"{path}.weight") or layer.get_submodule(path).weight

    def stack_of(paths: list[str]):
        parts = [weight(p) for p in paths]
        return stack(parts) if all(isinstance(p, torch.Tensor) for p in parts) else tuple(parts)

    qkv_bias = None
    if att.q_proj.bias is not None:
        qkv_bias = stack([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
    return {
        "ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight,
        "qkv": stack_of(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]), "qkv_bias": qkv_bias,
        "o": weight("self_attn.o_proj"), "gate_up": stack_of(["mlp.gate_proj", "mlp.up_proj"]),
        "down": weight("mlp.down_proj"), "inter": weight("mlp.gate_proj").shape[0],
    }


def supports(model) -> bool:
    """Llama-family layouts: full attention, SiLU gated MLP, biases only on q/k/v."""
    cfg = model.config
    if cfg.model_type not in ("llama", "qwen2", "mistral") or getattr(cfg, "hidden_act", "silu") != "silu":
        return False
    if getattr(model, "is_quantized", False) or getattr(cfg, "quantization_config", None):
        return False  # bitsandbytes layers must run their own kernels
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", cfg.model_type == "mistral"):
        return False  # a window needs its own mask rule; transformers handles it
    layer = model.model.layers[0]
    att, mlp = layer.self_attn, layer.mlp
    needed = [getattr(att, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    needed += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if any(m is None or not hasattr(m, "weight") for m in needed):
        return False
    return all(m.bias is None for m in needed[3:])


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class CompactModel(CachedModel):
    """CachedModel's contract (sync, extend, forward, truncate, keep_entries) on top
    of the compact forward and its in-place cache; masks and positions are built by
    CachedModel.forward, only the model call differs."""

    exact = True
    """Whether the forward must round exactly like transformers (a target must)."""
    decoder_class = CompactDecoder

    SLOT_FIELDS = ("kv_slot",)

    def __init__(self, model, *, row_invariant: bool = False, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.decoder = self.decoder_class(model, exact=self.exact, row_invariant=row_invariant)
        self.cache = None  # the decoder owns the keys and values

    def fresh_slot_state(self) -> dict:
        return super().fresh_slot_state() | {"cache": None, "kv_slot": self.decoder.new_slot()}

    @property
    def kv_slot(self) -> KVSlot:
        """The current slot's keys and values (they live in the decoder, which runs on them)."""
        return self.decoder.slot_kv

    @kv_slot.setter
    def kv_slot(self, slot: KVSlot) -> None:
        self.decoder.slot_kv = slot

    def kv_bytes_per_token(self) -> int:
        return self.decoder.kv_bytes_per_token()

    def pass_part(self, tokens: list[int], anc: np.ndarray, depths: list[int], base_pos: int) -> PassPart:
        """The current slot's share of a shared pass (see CachedModel.forward for the
        arguments)."""
        mask, positions = self.pass_inputs(tokens, anc, depths, base_pos)
        return PassPart(self.decoder.slot_kv, list(tokens), mask, positions)

    def weight_bytes(self) -> int:
        return self.decoder.weight_bytes()

    def reset(self) -> None:
        self.decoder.truncate(0)
        self.cached = []

    @property
    def cache_len(self) -> int:
        return self.decoder.length

    def truncate(self, keep: int) -> None:
        self.decoder.truncate(keep)
        self.cached = self.cached[:keep]

    def keep_entries(self, positions: list[int]) -> None:
        self.decoder.keep_entries(positions)

    def _run(self, tokens: list[int], mask: torch.Tensor, positions: torch.Tensor, prefill: bool) -> torch.Tensor:
        with attention_kernels(positions.device):
            logits = self.decoder.forward(tokens, mask, positions, prefill=prefill)
        self.last_hidden = self.decoder.last_hidden
        return logits
