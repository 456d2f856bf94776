"""The feature drafter's weights file, and how it joins the target at load.

A weights file (bf16, ~8 MB for SmolLM2) holds the drafter's input projection `fc`
([hidden, 2 * hidden]: token embedding and target feature in, one hidden state out),
one Llama decoder layer of the target's shape, and a final norm. The embeddings and
the head are the target's own tensors, shared in memory, never copied: the drafter's
tokens are the target's by construction.

scripts/train_drafter.py trains one for the built-in SmolLM2 on the target's replies
to 1000 chat requests (none of them the benchmark's) and writes it to the user cache
(`trained_path()`), where an 'eagle' minion without a path finds it; the file's
metadata records the training figures and the checksum of the target weights. None
ships with the package: trained on what 2 cores make in half an hour (130k tokens)
it agrees with the target on 49% of held-out tokens and 26-44% on the benchmark's
requests, far below the llama.cpp substitute's 85%, so it does not pay (README).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from minions_local.core.errors import ModelLoadError
from minions_local.models.builtin import SMOLLM2, models_cache

RETRAIN = "train one with python scripts/train_drafter.py all (~35 minutes on 2 cores)"
LAYER_PREFIX = "model.layers.0."


def weights_named(spec: str) -> str | None:
    """For a minion spelled 'eagle' or 'eagle:FILE' (the API's and the command line's
    short form), its weights file ('' for the default); None for any other spec."""
    if spec == "eagle" or spec.startswith("eagle:"):
        return spec.removeprefix("eagle").removeprefix(":")
    return None


def trained_path() -> Path:
    """Where scripts/train_drafter.py writes the built-in SmolLM2's drafter."""
    return models_cache() / f"{SMOLLM2}-eagle.safetensors"


def drafter_config(target_config):
    """The target's configuration cut to the drafter's one layer."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    return config


def write_weights(tensors: dict, info: dict, path: Path) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt", "drafter": json.dumps(info, sort_keys=True)})
    return path


def read_weights(path: Path) -> dict:
    """The tensors of a drafter file, or a ModelLoadError that says how to get a good
    one. (Its metadata's "drafter" entry records how it was trained.)"""
    from safetensors import safe_open

    if not path.is_file():
        raise ModelLoadError(f"The feature drafter's weights are missing ({path}): {RETRAIN}, or give the "
                             f"'eagle' minion the path of a weights file.")
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # safetensors raises its own types for a damaged file
        raise ModelLoadError(f"The feature drafter's weights in {path} are damaged ({err}): {RETRAIN}.") from None
    if "fc.weight" not in tensors or not any(k.startswith(LAYER_PREFIX) for k in tensors):
        raise ModelLoadError(f"{path} is not a feature drafter (no fc.weight or layer 0): {RETRAIN}.")
    return tensors


def build_drafter(target_model, path: Path):
    """(a one-layer LlamaForCausalLM on the target's embeddings and head, fc weight),
    in the target's dtype and device; refused when the shapes do not match the target."""
    import torch
    from transformers import AutoModelForCausalLM

    tensors = read_weights(path)
    hidden = int(target_model.config.hidden_size)
    if tuple(tensors["fc.weight"].shape) != (hidden, 2 * hidden):
        raise ModelLoadError(f"The feature drafter in {path} was trained for a target of hidden size "
                             f"{tensors['fc.weight'].shape[0]}, not this target's {hidden}: train one for it with "
                             f"scripts/train_drafter.py.")
    embed = target_model.get_input_embeddings().weight
    config = drafter_config(target_model.config)
    config.tie_word_embeddings = False  # the head is set by hand below (tied or not, it is the target's)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    own = {k: v for k, v in tensors.items() if k != "fc.weight"}
    try:
        model.load_state_dict(own, strict=False, assign=True)
    except RuntimeError as err:
        raise ModelLoadError(f"The feature drafter in {path} does not fit this target's layer shape ({err}).") from None
    model.model.embed_tokens.weight = embed
    model.lm_head.weight = target_model.get_output_embeddings().weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"The feature drafter in {path} lacks {', '.join(missing[:3])}: {RETRAIN}.")
    model.model.rotary_emb = target_model.model.rotary_emb  # same positions, same RoPE: shared too
    if any(b.is_meta for b in model.buffers()):
        raise ModelLoadError(f"The feature drafter for this {config.model_type} target has state this loader "
                             f"does not build; use another minion kind.")
    model.to(device=embed.device, dtype=embed.dtype)
    model.eval()
    return model, tensors["fc.weight"].to(device=embed.device, dtype=embed.dtype)
