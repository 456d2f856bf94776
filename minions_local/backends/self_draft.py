"""A shallow self-draft: the target's first layers, then its final norm and head.

Early layers of a decoder already hold much of the next-token guess (the "logit
lens"); running only K of them through the target's own norm and head drafts in
about K/L of a pass. It is loaded as its own model from the target's folder (the
first K layers' tensors are read, the rest skipped), so it shares nothing mutable
with the target, and runs as an HF minion on the compact forward.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from minions_local.backends.hf import check_model_folder, load_config
from minions_local.backends.hf_minion import HFMinion
from minions_local.core.errors import ModelLoadError


def load_self_draft(folder: str | Path, layers: int, *, dtype: torch.dtype | None, device: str,
                    name: str | None = None) -> HFMinion:
    """An HFMinion running the first `layers` decoder layers of the model in `folder`."""
    from transformers import AutoModelForCausalLM

    path = check_model_folder(folder, "self-draft minion")
    total = int(load_config(path, "self-draft minion").num_hidden_layers)
    if not 1 <= layers < total:
        raise ModelLoadError(f"A self-draft runs some of the target's {total} layers: 'layers' must be 1 to "
                             f"{total - 1}, got {layers}.")
    with _quiet_load_report():
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, num_hidden_layers=layers, dtype=dtype if dtype is not None else "auto",
                local_files_only=True, attn_implementation="sdpa")
        except Exception as e:  # safetensors/torch raise their own types; all mean "unusable files"
            raise ModelLoadError(f"Could not load the first {layers} layers of {path} as a self-draft: {e}. "
                                 f"The weights may be damaged: restore the folder.") from None
    model.to(device).eval().requires_grad_(False)
    return HFMinion(model, name=name or f"self-draft-{layers}", release_weights=True)


@contextlib.contextmanager
def _quiet_load_report():
    """transformers lists every skipped layer tensor as UNEXPECTED; skipping them is the point."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
