"""Building a causal LM without allocating its decoder layers.

The model is created on the meta device from its config; then only the resident
parts (embeddings, final norm, lm_head, rotary tables) are materialized from the
checkpoint. Decoder-layer weights never exist as ordinary tensors unless a layer is
planned resident, so a target larger than RAM can be loaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from minions_local.core.errors import ModelLoadError
from minions_local.offload.checkpoint import Checkpoint


def skeleton_model(folder: Path, dtype: torch.dtype, attn_implementation: str | None) -> nn.Module:
    """The model with every parameter and buffer on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM  # here: half a second of every engine's import

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the config of {folder}: {e}") from e
    kwargs = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    except ValueError as e:
        raise ModelLoadError(f"{folder}: {e}. Streaming supports causal LMs such as Llama, Qwen2 and Mistral.") from e
    return model


def decoder_layers(model: nn.Module) -> tuple[nn.ModuleList, str]:
    """The decoder layers (`model.model.layers`) and their parameter-name prefix."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ModelLoadError(
            f"{type(model).__name__} has no model.model.layers; streaming supports decoder-only "
            "architectures laid out like Llama, Qwen2 and Mistral."
        )
    return layers, "model.layers"


def _set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    model.get_submodule(owner)._parameters[attr] = nn.Parameter(value, requires_grad=False)


def load_resident_parts(model: nn.Module, ckpt: Checkpoint, prefix: str, device: torch.device,
                        dtype: torch.dtype) -> int:
    """Materialize everything outside the decoder layers; returns the bytes placed."""
    placed = 0
    missing = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if name.startswith(prefix + "."):
            continue
        if name not in ckpt:
            missing.append(name)
            continue
        value = ckpt.get(name).to(device=device, dtype=dtype if param.is_floating_point() else param.dtype)
        _set_parameter(model, name, value)
        placed += value.numel() * value.element_size()
    _tie_output_embeddings(model, missing, ckpt)
    rebuild_meta_buffers(model, ckpt, prefix, device)
    return placed


def _tie_output_embeddings(model: nn.Module, missing: list[str], ckpt: Checkpoint) -> None:
    if not missing:
        return
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    tied = getattr(model.config, "tie_word_embeddings", False) or getattr(
        model.config.get_text_config(), "tie_word_embeddings", False
    )
    out_names = {n for n, p in model.named_parameters(remove_duplicate=False) if out is not None and p is out.weight}
    if tied and out is not None and set(missing) <= out_names | {"lm_head.weight"}:
        out.weight = inp.weight
        return
    raise ModelLoadError(f"{ckpt.folder} lacks {missing[:3]}; the checkpoint does not match its config.json.")


def rebuild_meta_buffers(model: nn.Module, ckpt: Checkpoint | None, prefix: str, device: torch.device) -> None:
    """Rotary tables are computed, not stored: re-create their modules for real."""
    for mod_name, module in list(model.named_modules()):
        if mod_name.startswith(prefix + ".") or not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if hasattr(module, "rope_type") or "Rotary" in type(module).__name__:
            fresh = type(module)(config=module.config).to(device)
            owner, _, attr = mod_name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, fresh)
            continue
        for attr, buf in list(module._buffers.items()):
            key = f"{mod_name}.{attr}"
            if buf is not None and buf.is_meta:
                if ckpt is None or key not in ckpt:
                    raise ModelLoadError(f"buffer {key} is neither stored nor recomputable; unsupported architecture.")
                module._buffers[attr] = ckpt.get(key).to(device)
