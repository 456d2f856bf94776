"""Whether a model folder's config.json describes the weights beside it.

transformers builds the model from config.json and then fills it from the
*.safetensors files. When the two disagree it loads anyway: with num_hidden_layers 4
against a 6-layer checkpoint two layers are silently dropped, with 8 two layers run
on random weights, and only a load report on stderr says so. A wrong vocab_size or
hidden_size fails, but with an error that blames the weights. Here the numbers in
config.json are compared with the tensor shapes in the safetensors headers (no
weights are read), so the refusal can name config.json and the numbers that differ.

The layout checked is the Llama one, which Qwen2 and Mistral share
(`model.layers.N.*`, `model.embed_tokens.weight`); names it does not find are not
checked, and the load report (or the streaming loader's own comparison) catches
what these numbers miss.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from minions_local.core.errors import ModelLoadError

Shapes = Mapping[str, tuple[int, ...]]

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
FIRST_UP = "model.layers.0.mlp.up_proj.weight"
FIRST_Q = "model.layers.0.self_attn.q_proj.weight"
FIRST_K = "model.layers.0.self_attn.k_proj.weight"
REMEDY = "Restore the config.json that came with these weights (re-download or re-export the model)."


def _setting(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _layers_held(shapes: Shapes) -> int | None:
    found = [int(m.group(1)) for name in shapes if (m := LAYER.match(name))]
    return max(found) + 1 if found else None


def _rows(shapes: Shapes, name: str) -> int | None:
    shape = shapes.get(name)
    return shape[0] if shape is not None and len(shape) == 2 else None


def _cols(shapes: Shapes, name: str) -> int | None:
    shape = shapes.get(name)
    return shape[1] if shape is not None and len(shape) == 2 else None


def disagreements(config: Any, shapes: Shapes) -> list[str]:
    """Each number of config.json that the stored tensors contradict, as a phrase."""
    found = []
    want, held = _setting(config, "num_hidden_layers"), _layers_held(shapes)
    if want is not None and held is not None and want != held:
        if want > held:
            fate = f"layers {held}-{want - 1} would run on random weights" if want - held > 1 else \
                f"layer {held} would run on random weights"
        else:
            fate = f"layers {want}-{held - 1} would be dropped" if held - want > 1 else f"layer {want} would be dropped"
        found.append(f"num_hidden_layers is {want} but the weights hold {held} layers ({fate})")
    if getattr(config, "quantization_config", None):
        return found  # pre-quantized tensors are packed: their shapes are not the config's
    vocab, hidden = _setting(config, "vocab_size"), _setting(config, "hidden_size")
    if vocab is not None and _rows(shapes, EMBED) not in (None, vocab):
        found.append(f"vocab_size is {vocab} but the embedding ({EMBED}) has {_rows(shapes, EMBED)} rows")
    elif vocab is not None and _rows(shapes, HEAD) not in (None, vocab):
        found.append(f"vocab_size is {vocab} but the output layer ({HEAD}) has {_rows(shapes, HEAD)} rows")
    if hidden is not None and _cols(shapes, EMBED) not in (None, hidden):
        found.append(f"hidden_size is {hidden} but the embedding ({EMBED}) is {_cols(shapes, EMBED)} wide")
        return found  # every other width follows from this one
    inner = _setting(config, "intermediate_size")
    if inner is not None and _rows(shapes, FIRST_UP) not in (None, inner):
        found.append(f"intermediate_size is {inner} but {FIRST_UP} has {_rows(shapes, FIRST_UP)} rows")
    heads, kv_heads = _setting(config, "num_attention_heads"), _setting(config, "num_key_value_heads")
    head_dim = _setting(config, "head_dim") or (hidden // heads if hidden and heads else None)
    if heads and head_dim and _rows(shapes, FIRST_Q) not in (None, heads * head_dim):
        found.append(f"num_attention_heads x head_dim is {heads} x {head_dim} = {heads * head_dim} but {FIRST_Q} "
                     f"has {_rows(shapes, FIRST_Q)} rows")
    if kv_heads and head_dim and _rows(shapes, FIRST_K) not in (None, kv_heads * head_dim):
        found.append(f"num_key_value_heads x head_dim is {kv_heads} x {head_dim} = {kv_heads * head_dim} but "
                     f"{FIRST_K} has {_rows(shapes, FIRST_K)} rows")
    return found


def mismatch_error(folder: Path, found: list[str]) -> ModelLoadError:
    return ModelLoadError(f"{folder / 'config.json'} does not match the weights beside it (*.safetensors): "
                          f"config.json says {'; '.join(found)}. {REMEDY}")


def check_config_matches(folder: Path, config: Any, shapes: Shapes) -> None:
    """Raise ModelLoadError naming config.json and the numbers when they contradict the weights."""
    found = disagreements(config, shapes)
    if found:
        raise mismatch_error(folder, found)


def _sample(names: Iterable[str], limit: int = 3) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def unloaded_weights_error(folder: Path, config: Any, shapes: Shapes, *, missing: Iterable[str] = (),
                           unexpected: Iterable[str] = (), mismatched: Iterable[str] = ()) -> ModelLoadError:
    """The refusal for a load that would leave weights random (missing), unused
    (unexpected) or reshaped (mismatched): the numbers when they explain it, else the names."""
    found = disagreements(config, shapes)
    if found:
        return mismatch_error(folder, found)
    missing, unexpected, mismatched = set(missing), set(unexpected), set(mismatched)
    parts = []
    if missing:
        parts.append(f"{len(missing)} weights that config.json asks for are not in the *.safetensors files, so they "
                     f"would run on random values ({_sample(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} weights in the files have no place in the model config.json describes, so "
                     f"they would be dropped ({_sample(unexpected)})")
    if mismatched:
        parts.append(f"{len(mismatched)} weights have another shape than config.json gives them "
                     f"({_sample(mismatched)})")
    return ModelLoadError(f"{folder / 'config.json'} does not match the weights beside it: {'; '.join(parts)}. "
                          f"{REMEDY}")
