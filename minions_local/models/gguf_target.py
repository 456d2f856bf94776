"""A GGUF file as the target: its config, tokenizer and tensor names, from its metadata.

The weights stay in the GGUF (offload/gguf_streamed.py streams them as their blocks).
What the rest of the engine reads from a model folder -- config.json, the tokenizer
and its chat template, generation_config.json -- is written once into a small side
folder in the user cache (no weights in it), keyed by the file's path and rebuilt
when the file changes. transformers reads the tokenizer from the GGUF (~7-15 s on 2
busy cores, hence the cache); the config is built here from the architecture's keys
(`llama.block_count`, ...), which is quicker and says exactly which key is missing.

Supported: the architectures llama.cpp writes as 'llama' (Llama, and Mistral, which
its converter writes as Llama), 'mistral' and 'qwen2'. llama.cpp's converter permutes
the rows of a Llama's q and k projections for its rotary layout; `row_order` gives the
permutation that undoes it (transformers' GGUF loader undoes the same).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from minions_local.core.errors import ModelLoadError
from minions_local.core.events import LoadProgress
from minions_local.models.builtin import models_cache
from minions_local.models.gguf_file import GGUFFile, read_gguf

FORMAT_VERSION = 1
SOURCE_FILE = "gguf_source.json"

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""GGUF architecture -> the transformers class that runs it."""

PERMUTED_QK = ("llama", "mistral")
"""Architectures whose q/k rows llama.cpp's converter permutes (Qwen2 it leaves alone)."""

LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
"""GGUF name within `blk.N.` -> parameter name within a transformers decoder layer."""

RESIDENT_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                    "output.weight": "lm_head.weight"}

Progress = Callable[[LoadProgress], None]


@dataclass(frozen=True)
class GGUFTarget:
    """A GGUF file read as a target: the parsed header and its config as transformers wants it."""

    file: GGUFFile
    config: dict

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    def layer_tensors(self, i: int) -> dict[str, str]:
        """Parameter name within decoder layer i -> the GGUF tensor holding it."""
        return {hf: f"blk.{i}.{name}" for name, hf in LAYER_TENSORS.items() if f"blk.{i}.{name}" in self.file.tensors}

    def row_order(self, hf_name: str) -> tuple[int, int] | None:
        """(heads, rows) when the GGUF's rows of this layer parameter are permuted
        (a Llama's q and k), else None; `hf_rows(heads, rows)` gives the order."""
        if self.file.architecture not in PERMUTED_QK:
            return None
        if hf_name.startswith("self_attn.q_proj."):
            return int(self.config["num_attention_heads"]), int(self.config["num_attention_heads"]) * self.head_dim
        if hf_name.startswith("self_attn.k_proj."):
            return int(self.config["num_key_value_heads"]), int(self.config["num_key_value_heads"]) * self.head_dim
        return None

    @property
    def head_dim(self) -> int:
        return int(self.config["head_dim"])


def hf_rows(heads: int, rows: int) -> list[int]:
    """For each row of the transformers weight, the GGUF row that holds it.

    llama.cpp stores head h's rows in the order (pair i, half j) where transformers has
    (half j, pair i): rows interleave the two halves of each head's rotary dimensions."""
    half = rows // heads // 2
    return [h * 2 * half + i * 2 + j for h in range(heads) for j in range(2) for i in range(half)]


def open_target(path: str | os.PathLike) -> GGUFTarget:
    """Read a GGUF file as a target; ModelLoadError names the file and what is wrong."""
    file = read_gguf(path)
    return GGUFTarget(file, hf_config(file))


def hf_config(file: GGUFFile) -> dict:
    """The transformers config (as config.json's dict) of a Llama / Mistral / Qwen2 GGUF."""
    arch = file.architecture
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{file.path} holds a '{arch}' model; a GGUF target may be "
                             f"{', '.join(sorted(ARCHITECTURES))} (Llama, Mistral, Qwen2). Use it as an HF folder "
                             f"if transformers supports it, or pick another target.")

    def need(key: str):
        value = file.arch_value(key)
        if value is None:
            raise ModelLoadError(f"{file.path} lacks the metadata key '{arch}.{key}'; the file is incomplete or "
                                 f"was written by a tool this loader does not know. Re-export it with llama.cpp's "
                                 f"convert_hf_to_gguf.py.")
        return value

    if "token_embd.weight" not in file.tensors:
        raise ModelLoadError(f"{file.path} has no token_embd.weight tensor, so it is not a complete {arch} model.")
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    scaling = file.arch_value("rope.scaling.type")
    if "rope_freqs.weight" in file.tensors or scaling not in (None, "none", "linear"):
        kind = scaling if scaling not in (None, "none") else "per-frequency factors (rope_freqs.weight, Llama 3.1)"
        raise ModelLoadError(f"{file.path} uses rotary scaling of the kind {kind!r}, which the GGUF target does "
                             f"not support yet (plain and linear rotary embeddings are). Use the model's HF folder.")
    rope = {"rope_type": "default", "rope_theta": float(file.arch_value("rope.freq_base", 10000.0))}
    if scaling == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(file.tensors["token_embd.weight"].shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(file.arch_value("attention.head_count_kv", heads)),
        "head_dim": int(file.arch_value("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(file.arch_value("context_length", 4096)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope,
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id"):
        value = file.metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int):
            config[key] = value
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    if arch == "mistral":
        config["sliding_window"] = file.arch_value("attention.sliding_window")
    return config


# -- the side folder: config, tokenizer, generation config ------------------------------


def side_folder(path: Path) -> Path:
    """Where the side folder of the GGUF at `path` lives (one per absolute path)."""
    resolved = path.expanduser().resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    return models_cache() / "gguf" / f"{resolved.stem}-{digest}"


def ensure_side_folder(target: GGUFTarget, progress: Progress | None = None) -> Path:
    """The side folder for `target`, written (or rewritten, when the file changed) when needed."""
    folder = side_folder(target.path)
    stamp = {"format": FORMAT_VERSION, "source": str(target.path.resolve()), "fingerprint": target.file.fingerprint()}
    try:
        if json.loads((folder / SOURCE_FILE).read_text()) == stamp:
            return folder
    except (OSError, ValueError):
        pass  # not made yet, or damaged: make it
    if progress:
        progress(LoadProgress("target", "disk", 0, 1, f"reading the tokenizer of {target.path.name} (once)"))
    partial = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
        _write_side_folder(target, partial)
        (partial / SOURCE_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
        old = folder.parent / f".{folder.name}.old-{os.getpid()}"
        if folder.exists():
            folder.rename(old)
        partial.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as err:
        raise ModelLoadError(f"Could not write the GGUF target's tokenizer and config to {folder}: {err}. Free "
                             f"some space or set MINIONS_CACHE_DIR to a writable folder.") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    if progress:
        progress(LoadProgress("target", "disk", 1, 1, "tokenizer ready"))
    return folder


def _write_side_folder(target: GGUFTarget, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    config = dict(target.config)
    model_type = config.pop("model_type")
    AutoConfig.for_model(model_type, **config).save_pretrained(out)
    generation = {k: target.config[k] for k in ("bos_token_id", "eos_token_id") if k in target.config}
    GenerationConfig(**generation).save_pretrained(out)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # transformers' progress bars would tear up the chat app
            tokenizer = AutoTokenizer.from_pretrained(target.path.parent, gguf_file=target.path.name,
                                                      local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, NotImplementedError) as err:
        raise ModelLoadError(f"The tokenizer in {target.path} cannot be read ({type(err).__name__}: {err}). "
                             f"Re-export the GGUF with a current llama.cpp, or use the model's HF folder.") from None
    finally:
        hf_logging.set_verbosity(level)
    tokenizer.save_pretrained(out)
