"""Write a GGUF file from one of our HF checkpoints (Llama, Qwen2, Mistral).

Why not llama.cpp's `convert_hf_to_gguf.py`: it ships only in the llama.cpp sources and
rejects any BPE pre-tokenizer whose hash it does not know, which is every tokenizer we
train ourselves. The format is simple enough to write directly with the `gguf` package:
config -> metadata keys, tokenizer.json -> vocabulary/merges, safetensors -> tensors
(always f32 first; smaller types come from llama.cpp's own quantizer so they are
exactly what llama.cpp would produce).

Layout facts that matter for exactness:
  * GGUF stores a numpy [out, in] matrix as ne = [in, out], which is what llama.cpp
    expects, so HF weights are written untransposed.
  * llama.cpp runs the "llama" architecture (Llama and Mistral) with interleaved
    rotary pairs, while HF checkpoints use the rotate-half layout: the rows of q and k
    (weights and biases) are permuted per head. Qwen2 runs with rotate-half ("neox")
    rope in llama.cpp, so its q/k rows stay as they are.
  * Only the "gpt-2" byte-level pre-tokenizer is mapped, because only for it does
    llama.cpp reproduce HF tokenization exactly (PLATFORM_FACTS.md).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from minions_local.core.errors import ModelLoadError

GgufType = Literal["f32", "f16", "q8_0", "q4_0"]

# llama.cpp's llama_ftype values for the quantizer (LLAMA_FTYPE_MOSTLY_*).
_LLAMA_FTYPE: dict[str, int] = {"f16": 1, "q4_0": 2, "q8_0": 7}

# HF architecture -> (GGUF architecture, permute q/k rows for interleaved rope)
_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("llama", True),
    "MistralForCausalLM": ("llama", True),
    "Qwen2ForCausalLM": ("qwen2", False),
}

# Token types of the GGUF vocabulary (gguf.TokenType).
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5


@dataclass(slots=True)
class GgufHyperparams:
    """The hyperparameters llama.cpp reads from a GGUF's metadata, taken from config.json."""

    architecture: str  # GGUF architecture name
    permute_qk: bool
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    rms_eps: float
    rope_theta: float
    context_length: int
    tie_embeddings: bool
    head_dim: int = 0
    rope_linear_factor: float | None = None

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden // self.heads

    def add_to(self, writer) -> None:
        """Write them into a `gguf.GGUFWriter`'s metadata (the vocabulary size aside)."""
        import gguf

        writer.add_context_length(self.context_length)
        writer.add_embedding_length(self.hidden)
        writer.add_block_count(self.layers)
        writer.add_feed_forward_length(self.intermediate)
        writer.add_head_count(self.heads)
        writer.add_head_count_kv(self.kv_heads)
        writer.add_key_length(self.head_dim)
        writer.add_value_length(self.head_dim)
        writer.add_rope_dimension_count(self.head_dim)
        writer.add_rope_freq_base(float(self.rope_theta))
        if self.rope_linear_factor:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(self.rope_linear_factor))
        writer.add_layer_norm_rms_eps(float(self.rms_eps))


@dataclass(slots=True)
class GgufVocab:
    """The byte-level BPE vocabulary as llama.cpp reads it."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre_tokenizer: str
    special_ids: dict[str, int] = field(default_factory=dict)  # bos/eos/unk/pad -> id
    add_bos: bool = False
    chat_template: str | None = None

    def add_to(self, writer) -> None:
        """Write the tokens, merges and special ids into a `gguf.GGUFWriter`'s metadata
        (whether to add BOS and the chat template are the caller's)."""
        writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
        writer.add_tokenizer_pre(self.pre_tokenizer)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        writer.add_token_merges(self.merges)
        for role, token_id in self.special_ids.items():
            getattr(writer, f"add_{role}_token_id")(token_id)


def read_hyperparams(src: Path) -> GgufHyperparams:
    config = _read_json(src / "config.json")
    arch_names = config.get("architectures") or []
    arch = next((a for a in arch_names if a in _ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{src}: architecture {arch_names or '(none)'} cannot be exported to GGUF; "
            f"supported: {', '.join(_ARCHITECTURES)}."
        )
    gguf_arch, permute = _ARCHITECTURES[arch]
    if config.get("mlp_bias"):
        raise ModelLoadError(f"{src}: MLP biases (mlp_bias=true) have no GGUF tensor in llama.cpp's llama graph.")
    if config.get("use_sliding_window"):
        raise ModelLoadError(f"{src}: Qwen2 sliding-window attention is not supported by the GGUF export.")
    # transformers 5 folds rope settings into `rope_parameters`; older files use
    # `rope_theta` + `rope_scaling`.
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise ModelLoadError(f"{src}: rope scaling '{rope_type}' is not supported by the GGUF export.")
    heads = config["num_attention_heads"]
    return GgufHyperparams(
        architecture=gguf_arch,
        permute_qk=permute,
        vocab_size=config["vocab_size"],
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        intermediate=config["intermediate_size"],
        rms_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        context_length=config.get("max_position_embeddings", 2048),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=config.get("head_dim") or 0,
        rope_linear_factor=rope.get("factor") if rope_type == "linear" else None,
    )


def read_vocab(src: Path, vocab_size: int, pre_tokenizer: str | None = None) -> GgufVocab:
    """Vocabulary, merges and special tokens from tokenizer.json (+ tokenizer_config.json).

    `vocab_size` is the model's embedding row count: ids the tokenizer never produces
    are padded with unused tokens so llama.cpp's vocabulary matches the tensors.
    """
    path = src / "tokenizer.json"
    if not path.exists():
        raise ModelLoadError(f"{src}: no tokenizer.json; the GGUF export needs a fast (tokenizers) BPE tokenizer.")
    spec = _read_json(path)
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ModelLoadError(f"{src}: tokenizer model '{model.get('type')}' is not BPE; "
                             "only byte-level BPE tokenizers can be exported.")
    pre = pre_tokenizer or _detect_pre_tokenizer(spec, src)

    by_id: dict[int, tuple[str, int]] = {i: (t, _NORMAL) for t, i in model["vocab"].items()}
    for added in spec.get("added_tokens") or []:
        by_id[added["id"]] = (added["content"], _CONTROL if added.get("special") else _USER_DEFINED)
    n_tokenizer = max(by_id) + 1
    if n_tokenizer > vocab_size:
        raise ModelLoadError(f"{src}: the tokenizer has {n_tokenizer} tokens but the model only {vocab_size} rows.")
    tokens, types = [], []
    for i in range(vocab_size):
        text, kind = by_id.get(i, (f"[PAD{i}]", _UNUSED))
        tokens.append(text)
        types.append(kind)
    # tokenizers >= 0.20 saves merges as [left, right] pairs, older versions as "left right".
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]

    tok_config = _read_json(src / "tokenizer_config.json") if (src / "tokenizer_config.json").exists() else {}
    config = _read_json(src / "config.json")
    ids = {t: i for i, (t, _) in by_id.items()}
    special: dict[str, int] = {}
    for role in ("bos", "eos", "unk", "pad"):
        text = tok_config.get(f"{role}_token")
        if isinstance(text, dict):
            text = text.get("content")
        if isinstance(text, str) and text in ids:
            special[role] = ids[text]
        elif isinstance(config.get(f"{role}_token_id"), int):
            special[role] = config[f"{role}_token_id"]
    template = tok_config.get("chat_template")
    if template is None and (src / "chat_template.jinja").exists():
        template = (src / "chat_template.jinja").read_text()
    return GgufVocab(tokens=tokens, token_types=types, merges=merges, pre_tokenizer=pre, special_ids=special,
                     add_bos=_adds_bos(spec, tok_config), chat_template=template if isinstance(template, str) else None)


def _detect_pre_tokenizer(spec: dict[str, Any], src: Path) -> str:
    pre = spec.get("pre_tokenizer") or {}
    if spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) \
            and not pre.get("add_prefix_space", False):
        return "gpt-2"
    raise ModelLoadError(
        f"{src}: only the GPT-2 style byte-level pre-tokenizer (ByteLevel with its regex, no normalizer, no prefix "
        "space) is known to tokenize identically in llama.cpp; pass pre_tokenizer=<llama.cpp name> to override."
    )


def _adds_bos(spec: dict[str, Any], tok_config: dict[str, Any]) -> bool:
    if isinstance(tok_config.get("add_bos_token"), bool):
        return tok_config["add_bos_token"]
    post = spec.get("post_processor") or {}
    single = post.get("single") or [] if post.get("type") == "TemplateProcessing" else []
    return bool(single) and "SpecialToken" in single[0]


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp interleaved-pair rows, per head (weights or biases)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# HF tensor suffix -> GGUF tensor name (per layer: "blk.{i}." prefix)
_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_tensor_name(hf_name: str) -> str | None:
    if hf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[hf_name]
    parts = hf_name.split(".", 3)  # model.layers.{i}.{suffix}
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_TENSORS:
        return f"blk.{int(parts[2])}.{_LAYER_TENSORS[parts[3]]}"
    return None


def iter_tensors(src: Path, hparams: GgufHyperparams):
    """(GGUF name, float32 array) for every tensor, q/k rows permuted where needed."""
    from safetensors import safe_open

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{src}: no *.safetensors files (re-save the model with safe_serialization=True).")
    for file in files:
        # framework="pt" because numpy cannot hold bf16 checkpoints.
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                name = gguf_tensor_name(hf_name)
                if name is None:
                    if hf_name.endswith("rotary_emb.inv_freq"):
                        continue  # recomputed from rope_theta
                    raise ModelLoadError(f"{file}: tensor '{hf_name}' has no GGUF counterpart.")
                if name == "output.weight" and hparams.tie_embeddings:
                    continue
                array = f.get_tensor(hf_name).float().numpy()
                if hparams.permute_qk and (".attn_q." in name or ".attn_k." in name):
                    array = _unpermute_rope_rows(array, hparams.heads if ".attn_q." in name else hparams.kv_heads)
                yield name, np.ascontiguousarray(array, dtype=np.float32)


def export_gguf(src: str | os.PathLike[str], out: str | os.PathLike[str], *, type: GgufType = "f32",
                pre_tokenizer: str | None = None, threads: int | None = None) -> Path:
    """Write `out` (a .gguf file) from the HF checkpoint folder `src`.

    type: f32 is written directly; f16/q8_0/q4_0 are written as f32 to a temporary file
    and converted by llama.cpp's quantizer (needs llama-cpp-python).
    """
    src, out = Path(src).expanduser(), Path(out).expanduser()
    if type not in ("f32", *_LLAMA_FTYPE):
        raise ValueError(f"unknown GGUF type {type!r}; choose f32, f16, q8_0 or q4_0")
    hparams = read_hyperparams(src)
    vocab = read_vocab(src, hparams.vocab_size, pre_tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    if type == "f32":
        _write_f32(src, out, hparams, vocab)
        return out
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        f32 = Path(tmp) / "model-f32.gguf"
        _write_f32(src, f32, hparams, vocab)
        quantize_gguf(f32, out, type, threads=threads)
    return out


def _write_f32(src: Path, out: Path, hparams: GgufHyperparams, vocab: GgufVocab) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(out), hparams.architecture)
    writer.add_name(src.name)
    writer.add_file_type(0)  # ALL_F32
    writer.add_vocab_size(hparams.vocab_size)
    hparams.add_to(writer)
    vocab.add_to(writer)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(False)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)

    for name, array in iter_tensors(src, hparams):
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize_gguf(src: str | os.PathLike[str], out: str | os.PathLike[str], type: GgufType,
                  *, threads: int | None = None) -> Path:
    """Convert an f32/f16 GGUF to `type` with llama.cpp's own quantizer."""
    import ctypes

    from minions_local.backends.gguf import import_llama_cpp

    llama_cpp = import_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _LLAMA_FTYPE[type]
    params.nthread = threads or os.cpu_count() or 1
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        raise ModelLoadError(f"llama.cpp could not quantize {src} to {type} (status {status}).")
    return Path(out)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing: is {path.parent} a Hugging Face model folder?") from None
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{path} is not valid JSON ({err}).") from None
