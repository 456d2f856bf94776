"""Running one Hugging Face causal LM over packed token trees with a KV cache.

Shared by the target and the HF minions: loading a model folder with messages a
user can act on, a forward over new tokens with an explicit tree mask and
positions, and the cache edits speculation needs (crop, keep selected entries).
"""

from __future__ import annotations

import inspect
import json
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from minions_local.core.errors import ModelLoadError
from minions_local.core.tree import tree_attention_mask
from minions_local.core.protocols import common_prefix_len
from minions_local.core.slots import SlotStates
from minions_local.offload.checkpoint import Checkpoint
from minions_local.offload.config_match import check_config_matches, unloaded_weights_error
from minions_local.offload.dtypes import compute_dtype

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")

CUDA_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The attention kernels a pass may use on CUDA. Not cuDNN's: on an H200 torch picks
it for masked bf16 attention, and it builds an execution plan for every new shape, on
the CPU, ~10 ms a call. Every pass of a decode has a new shape (the cache grows by the
accepted tokens, the tree changes size), so the demo chat ran at 15 tok/s where the
same passes, once seen, ran at 140 (docs/gpu/, 2026-11-28). Flash attention takes no
mask, so every tree pass would fall to another kernel anyway; the memory-efficient one
serves every pass, masked or not, with math as the fallback for what it cannot run."""


def attention_kernels(device: torch.device):
    """The context a pass runs in: CUDA_ATTENTION on CUDA, torch's own choice elsewhere."""
    return sdpa_kernel(CUDA_ATTENTION) if device.type == "cuda" else nullcontext()


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A compute dtype from a dtype or a name (ValueError if unknown); None stays None."""
    return None if dtype is None else compute_dtype(dtype)


def check_model_folder(path: str | Path, role: str) -> Path:
    """Fail early, with a remedy, on a folder that cannot be a model."""
    from minions_local.models.demo import is_demo_path, verify_member

    path = Path(path).expanduser()
    if is_demo_path(path):
        verify_member(str(path))
    if not path.is_dir():
        raise ModelLoadError(f"The {role} model folder {path} does not exist. Check the path (or the profile's "
                             f"'path' field); a Hugging Face model folder holds config.json and *.safetensors.")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json, so it is not a Hugging Face model folder ({role}). "
                             f"Point at the folder that contains config.json and the *.safetensors files.")
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path / 'config.json'} is damaged ({e}). Restore the file (re-download or "
                             f"re-export the model).") from None
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no *.safetensors weights ({role}). Only safetensors checkpoints are "
                             f"loaded; convert .bin weights with save_pretrained(safe_serialization=True).")
    return path


def load_config(path: Path, role: str):
    """The folder's config, refused (naming config.json and the numbers) when it does not
    describe the weights beside it; a damaged weights file is named here too."""
    try:
        from transformers import AutoConfig  # here: its import is half a second of every load

        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path / 'config.json'} cannot be used ({role}): {e}. Restore the config.json that "
                             f"came with these weights.") from None
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path} is a '{config.model_type}' model ({role}); supported architectures are "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
    check_config_matches(path, config, stored_shapes(path))
    return config


def stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensor shapes in the folder's safetensors headers (a damaged file is named)."""
    checkpoint = Checkpoint(path)
    try:
        return checkpoint.shapes()
    finally:
        checkpoint.close()


def load_causal_lm(path: str | Path, role: str, dtype: torch.dtype | None, device: str,
                   quantization: str = "none"):
    """A model ready for tree forwards, in eval mode, without gradients.

    quantization 'nf4' / 'int8' stores the weights with bitsandbytes (on `device`)."""
    path = check_model_folder(path, role)
    config = load_config(path, role)
    extra = _bitsandbytes_options(quantization, dtype, device, role)
    try:
        from transformers import AutoModelForCausalLM

        model, report = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype if dtype is not None else "auto", local_files_only=True, attn_implementation="sdpa",
            output_loading_info=True, **extra)
    except Exception as e:  # safetensors/torch raise their own types; all mean "unusable files"
        raise ModelLoadError(f"Could not load the {role} model from {path}: {e}\nThe weights may be damaged or "
                             f"incomplete: restore the folder (re-download, re-export, or for the shipped demo "
                             f"models reinstall minions-local or run scripts/train_demo_family.py).") from None
    # transformers loads a model whose weights do not fill it (or overfill it) and only
    # prints a report; a layer left random or dropped gives wrong output, so refuse.
    missing, unexpected = report.get("missing_keys") or (), report.get("unexpected_keys") or ()
    mismatched = [key[0] if isinstance(key, tuple) else key for key in report.get("mismatched_keys") or ()]
    if missing or unexpected or mismatched:
        raise unloaded_weights_error(path, config, stored_shapes(path), missing=missing, unexpected=unexpected,
                                     mismatched=mismatched)
    if not extra:
        model.to(device)
    model.eval().requires_grad_(False)
    return model


def _bitsandbytes_options(quantization: str, dtype: torch.dtype | None, device: str, role: str) -> dict:
    if quantization in ("none", None):
        return {}
    if quantization not in ("nf4", "int8"):
        raise ModelLoadError(f"Unknown quantization {quantization!r} for the {role}; use none, nf4 or int8.")
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise ModelLoadError(f"The {role} asks for {quantization} weights, which need bitsandbytes: "
                             f"pip install 'minions-local[cuda]' (or set quantization = \"none\").") from None
    if quantization == "nf4":
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                    bnb_4bit_compute_dtype=dtype or torch.bfloat16)
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    return {"quantization_config": config, "device_map": {"": device}}


def context_length(config) -> int:
    return int(getattr(config, "max_position_embeddings", 0) or 2048)


class CachedModel(SlotStates):
    """A causal LM plus the KV cache of one token sequence it has already run, per
    slot (core/slots.py: one sequence per request; the weights are shared).

    `cached` lists the tokens whose keys/values are in the cache, in cache order.
    """

    SLOT_FIELDS = ("cache", "cached")

    def __init__(self, model) -> None:
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.config.vocab_size)
        self.cache = _dynamic_cache()
        self.cached: list[int] = []

    def fresh_slot_state(self) -> dict:
        return super().fresh_slot_state() | {"cache": _dynamic_cache(), "cached": []}

    def reset(self) -> None:
        self.cache = _dynamic_cache()
        self.cached = []

    @property
    def cache_len(self) -> int:
        return self.cache.get_seq_length()

    def weight_bytes(self) -> int:
        """Bytes of the weights its forward reads."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def truncate(self, keep: int) -> None:
        """Drop every cache entry after the first `keep` (tree entries included)."""
        drop = self.cache_len - keep
        if drop > 0:
            self.cache.crop(-drop)  # transformers 5 takes a negative count to drop
        self.cached = self.cached[:keep]

    def keep_entries(self, positions: list[int]) -> None:
        """Keep only the cache entries at `positions` (in that order), e.g. the prefix
        plus the accepted path of a verified tree."""
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)

    def sync(self, tokens: list[int]) -> list[int]:
        """Keep the longest cached prefix of `tokens`; return the tokens still to run."""
        lcp = common_prefix_len(self.cached, tokens)
        self.truncate(lcp)
        return tokens[lcp:]

    @torch.inference_mode()
    def forward(self, tokens: list[int], anc: np.ndarray, depths: list[int], base_pos: int, *,
                prefill: bool = False) -> torch.Tensor:
        """Run new tokens on top of the cache; returns float32 logits [T, V], or [1, V]
        for the last token only when the tokens are a `prefill` chunk (see
        compact.CompactDecoder.forward).

        anc: [T, K] visibility of the last K cache entries + new tokens (K >= T; the
        entries before those are visible to all). A chain is lower-triangular [T, T].
        Positions are base_pos + depth; the new entries are appended to the cache.
        """
        mask, pos = self.pass_inputs(tokens, anc, depths, base_pos)
        return self._run(tokens, mask, pos, prefill)

    def pass_inputs(self, tokens: list[int], anc: np.ndarray, depths: list[int],
                    base_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The additive mask (1, 1, T, cache + T) and positions [1, T] of new tokens on
        top of the cache (see `forward`)."""
        prefix = self.cache_len + len(tokens) - anc.shape[1]
        mask = tree_attention_mask(anc, prefix, self.dtype, self.device)
        pos = torch.tensor([[base_pos + d for d in depths]], dtype=torch.long, device=self.device)
        return mask, pos

    def _run(self, tokens: list[int], mask: torch.Tensor, positions: torch.Tensor, prefill: bool) -> torch.Tensor:
        """The model call itself: logits [T, V] float32 ([1, V]: `prefill`), new
        entries appended to the cache."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        with attention_kernels(ids.device):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             **cache_kwargs(self.model, self.cache),
                             use_cache=True, output_hidden_states=self.keep_hidden, **self._keep_logits(prefill))
        self.cache = out.cache if hasattr(out, "cache") else out.past_key_values
        if self.keep_hidden:
            self.last_hidden = out.hidden_states[-1][0]  # transformers' last entry is the normed one
        return (out.logits[0, -1:] if prefill else out.logits[0]).float()

    def _keep_logits(self, prefill: bool) -> dict:
        """transformers' causal LMs compute the head on the last row only when asked
        (`logits_to_keep`); a model class without the argument computes every row."""
        if not prefill:
            return {}
        return {"logits_to_keep": 1} if _forward_takes(self.model, "logits_to_keep") else {}

    keep_hidden = False
    """Whether passes keep their final normed hidden states in `last_hidden` (a target
    does, for feature drafters; the compact forward always does, at no cost)."""
    last_hidden: torch.Tensor | None = None

    def extend(self, tokens: list[int], chunk: int = 512) -> torch.Tensor | None:
        """Run a chain of tokens (prefill), in chunks to bound memory; returns the last
        token's logits [1, V], or None when there was nothing to run."""
        logits, hidden = None, []
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            n = len(part)
            base = self.cache_len
            logits = self.forward(part, np.tril(np.ones((n, n), dtype=bool)), list(range(n)), base, prefill=True)
            self.cached.extend(part)
            if self.keep_hidden:
                hidden.append(self.last_hidden)
        if len(hidden) > 1:
            self.last_hidden = torch.cat(hidden)
        return logits


def _dynamic_cache():
    from transformers import DynamicCache

    return DynamicCache()


def cache_kwargs(model, cache) -> dict:
    """The KV cache as a causal LM's forward takes it: transformers 5.24 renamed
    `past_key_values` to `cache` (the old name still works there, with a FutureWarning
    printed into the user's chat, and goes at 5.40); older releases know only the old one."""
    return {"cache" if _forward_takes(model, "cache") else "past_key_values": cache}


def _forward_takes(model, keyword: str) -> bool:
    """Whether the model class's forward has this keyword (read once per class)."""
    key = (type(model), keyword)
    if key not in _FORWARD_TAKES:
        _FORWARD_TAKES[key] = keyword in inspect.signature(model.forward).parameters
    return _FORWARD_TAKES[key]


_FORWARD_TAKES: dict[tuple[type, str], bool] = {}
