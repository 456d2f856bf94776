"""What a model costs, from its shape alone: parameters, bytes per layer, KV bytes, flops.

The planner and the cost model need sizes without loading any weights (a 70B target
is usually not on the machine that runs `--plan`). Dimensions come from the model's
`config.json`, or from the known dimensions a profile lists, and everything else is
derived here, in one place, so the plan and the cost model agree.

Sizes are in bytes, counts in parameters; GB means 1e9 bytes throughout.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minions_local.core.errors import ProfileError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}

# Bytes per parameter of a quantized weight matrix, scales included. The target's
# streamed layers use our own packs (offload/quant.py): int8 with one 2-byte scale per
# row (negligible for wide layers), int4 with one 2-byte scale per group of 64.
# bitsandbytes nf4 (minions) keeps one absmax per 64 weights, itself 8-bit with double
# quantization (its default).
_QUANT_BYTES = {
    "int8": 1.0,
    "int4": 0.5 + 2 / 64,
    "nf4": 0.5 + (1 + 4 / 256) / 64,
    # llama.cpp's k-quant mixes for a 'substitute' minion (some tensors keep more bits):
    # averages from the sizes its quantizer lists for an 8B Llama.
    "q2_k": 0.37,
    "q3_k_s": 0.43,
    "q3_k_m": 0.47,
}


def bytes_per_param(quantization: str, dtype: str) -> float:
    """Storage bytes per weight of a matrix at `quantization` ('none' = dtype)."""
    if quantization in ("none", None):
        return float(DTYPE_BYTES[dtype])
    return _QUANT_BYTES[quantization]


@dataclass(frozen=True)
class ModelDims:
    """The shape of a decoder-only transformer (Llama/Qwen/Mistral family)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0
    """0 = hidden // heads."""
    tied_embeddings: bool = False
    max_context: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    # -- parameters -------------------------------------------------------------
    @property
    def attention_params(self) -> int:
        """q, k, v, o projections of one layer (biases are too small to count)."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        return 2 * q + kv

    @property
    def mlp_params(self) -> int:
        """gate, up and down projections of one gated MLP."""
        return 3 * self.hidden * self.intermediate

    @property
    def layer_params(self) -> int:
        return self.attention_params + self.mlp_params + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """The output projection (the embedding matrix itself when tied)."""
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Distinct parameters (a tied head is counted once)."""
        head = 0 if self.tied_embeddings else self.head_params
        return self.layers * self.layer_params + self.embedding_params + head + self.hidden

    # -- bytes --------------------------------------------------------------------
    def layer_bytes(self, quantization: str, dtype: str) -> int:
        """One decoder layer: matrices at `quantization`, norms at `dtype`."""
        matrices = self.attention_params + self.mlp_params
        norms = 2 * self.hidden * DTYPE_BYTES[dtype]
        return int(math.ceil(matrices * bytes_per_param(quantization, dtype))) + norms

    def embedding_bytes(self, dtype: str) -> int:
        # Embeddings and the head stay at the compute dtype: quantizing them costs
        # quality for little gain (AWQ, GPTQ and bitsandbytes all leave them alone).
        return self.embedding_params * DTYPE_BYTES[dtype]

    def head_bytes(self, dtype: str) -> int:
        return (self.head_params + self.hidden) * DTYPE_BYTES[dtype]

    def weight_bytes(self, quantization: str, dtype: str) -> int:
        """The whole model at `quantization` (decoder layers) and `dtype` (the rest)."""
        head = 0 if self.tied_embeddings else self.head_bytes(dtype)
        return self.layers * self.layer_bytes(quantization, dtype) + self.embedding_bytes(dtype) + head

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    # -- compute ------------------------------------------------------------------
    def flops_per_token(self, context: int = 0) -> float:
        """Forward flops for one new token attending to `context` earlier tokens."""
        matmul = 2 * (self.layers * (self.attention_params + self.mlp_params) + self.head_params)
        attention = 4 * self.layers * self.heads * self.head_dim * context
        return float(matmul + attention)

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelDims":
        """From a transformers `config.json` dict (Llama, Qwen2, Mistral, Gemma keys)."""
        cfg = config.get("text_config", config)  # multimodal wrappers nest the LM
        heads = int(cfg["num_attention_heads"])
        return cls(
            layers=int(cfg["num_hidden_layers"]),
            hidden=int(cfg["hidden_size"]),
            intermediate=int(cfg["intermediate_size"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            vocab=int(cfg["vocab_size"]),
            head_dim=int(cfg.get("head_dim") or 0),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_context=cfg.get("max_position_embeddings"),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelDims":
        path = Path(folder) / "config.json"
        try:
            return cls.from_config(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ProfileError(f"cannot read the model's dimensions from {path}: {err}") from err


def dims_from_gguf(path: Path) -> ModelDims:
    """From a GGUF model's metadata (every shard of a split one; its header only is read)."""
    from minions_local.core.errors import ModelLoadError
    from minions_local.models.gguf_file import read_model

    try:
        model = read_model(path)
        arch = model.architecture
    except ModelLoadError as err:
        raise ProfileError(str(err)) from None

    def get(key: str, default: Any = None) -> Any:
        value = model.arch_value(key, default)
        if value is None:
            raise ProfileError(f"{path} lacks {arch}.{key} in its metadata, so its shape is unknown: it is not a "
                               f"complete model GGUF. Re-download or re-export it.")
        return value

    try:
        heads = int(get("attention.head_count"))
        tokens = model.metadata.get("tokenizer.ggml.tokens")
        vocab = model.arch_value("vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
        return ModelDims(
            layers=int(get("block_count")),
            hidden=int(get("embedding_length")),
            intermediate=int(get("feed_forward_length")),
            heads=heads,
            kv_heads=int(get("attention.head_count_kv", heads)),
            vocab=int(vocab if vocab is not None else get("vocab_size")),
            head_dim=int(get("attention.key_length", 0) or 0),
            tied_embeddings="output.weight" not in model.tensors,
            max_context=model.arch_value("context_length"),
        )
    except (ValueError, TypeError) as err:  # a list where a count belongs, say (per-layer sizes)
        raise ProfileError(f"cannot read the model's dimensions from {path}'s metadata ({err}): this reader "
                           f"takes one head count and one MLP size for every layer.") from None


def dims_for(path: str | None, known: Any | None, what: str) -> ModelDims:
    """Dimensions of the model at `path`: its config.json when present, else `known`.

    `known` is a profile's `dims` section (anything with the ModelDims field names).
    The config wins because it describes the weights actually on disk.
    """
    folder = Path(path) if path else None
    if folder is not None and known is None and not folder.exists():
        raise ProfileError(f"the {what} {path} does not exist. Check the path (a model folder with a config.json, "
                           f"or a .gguf file).")
    if folder is not None and folder.is_file():
        folder = folder.parent  # a GGUF file: a config.json beside it, if any
    if folder is not None and (folder / "config.json").is_file():
        return ModelDims.from_folder(folder)
    if known is None and path and str(path).lower().endswith(".gguf") and Path(path).is_file():
        return dims_from_gguf(Path(path))
    if known is not None:
        fields = {k: v for k, v in known.model_dump().items() if k in ModelDims.__dataclass_fields__}
        return ModelDims(**{k: v for k, v in fields.items() if v is not None})
    where = f"no config.json in {path}" if path else "no path"
    raise ProfileError(
        f"the {what}'s dimensions are unknown ({where}). Point the profile at a model "
        f"folder with a config.json, or list them in the profile's [{what}.dims] table "
        "(layers, hidden, intermediate, heads, kv_heads, vocab)."
    )
