"""Turning paths into ready models: the target, each minion, and the checks between them.

A minion or budget policy object of a user's own is taken as it is, wrapped to answer
what the decode step asks it and it lacks (`as_minion`, `as_policy`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from minions_local.core.minion import BaseMinion, as_minion
from minions_local.core.protocols import Minion
from minions_local.offload.dtypes import fast_compute_dtype
from minions_local.backends.hf import check_model_folder, load_causal_lm, load_config, resolve_dtype
from minions_local.backends.hf_minion import HFMinion
from minions_local.backends.hf_target import HFTarget, exact_target
from minions_local.core.errors import ModelLoadError
from minions_local.core.events import LoadProgress, StepRecord
from minions_local.core.tiers import TIERS, streams
from minions_local.engine.text import load_tokenizer
from minions_local.models.gguf_file import shard_paths
from minions_local.models.vocabulary import mismatch, model_tokens, tokens_differ
from minions_local.speculation.budget import BudgetPolicy, PassRecord, StepBudget, TreeAsk

Progress = Callable[[LoadProgress], None]


@dataclass(frozen=True)
class MinionSpec:
    """A minion with placement options (what a profile's [[minions]] entry says)."""

    path: str
    name: str | None = None
    quantization: str = "none"
    """'none', or bitsandbytes 'nf4' / 'int8' (pays off on CUDA; works, slowly, on CPU)."""
    device: str | None = None
    dtype: str | None = None
    kind: str = "auto"
    """'auto' (by path: a .gguf file, 'ngram', 'eagle', or an HF folder), one made from
    the target's weights: 'substitute' (re-quantized to `quantization` by llama.cpp) or
    'self_draft' (its first `layers` layers), or 'eagle' (a feature drafter: `path` is
    its weights file, or empty for the one scripts/train_drafter.py trained for the
    built-in target)."""
    layers: int | None = None


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def resolve_compute_dtype(dtype: torch.dtype | None, compute: torch.dtype | str | None, device: str,
                          streamed: bool) -> torch.dtype | None:
    """What the target computes in, for weights in `dtype` (see Engine.from_pretrained).

    "auto" widens only a streamed target: there tree passes are what pays, and its
    layers still move as bf16. A resident one would hold twice the bytes for a wash
    (SmolLM2 in RAM on a 2-core AVX2 CPU: a 1-token pass 49 -> 65 ms, 16 nodes 327 -> 160)."""
    if compute is None or dtype is None:
        return dtype
    if compute == "auto":
        return fast_compute_dtype(dtype, device) if streamed else dtype
    return resolve_dtype(compute)


def load_target(path: str | Path, *, dtype: torch.dtype | None, device: str, tier: str,
                progress: Progress | None, stream_options: dict[str, Any],
                compute_dtype: torch.dtype | str | None = None) -> tuple[HFTarget, Any]:
    """The target wrapped for tree verification, resident or streamed; and its tokenizer.

    dtype: the weights' dtype (what streamed layers are stored and moved in);
    compute_dtype: what they are computed in (resolve_compute_dtype): bf16 weights
    streamed as bf16 and computed in float32, on a CPU without bf16 matmul kernels."""
    if tier not in TIERS:
        raise ValueError(f"target_tier must be one of {TIERS}, got {tier!r}")
    if is_gguf_path(path):
        return _load_gguf_target(Path(path).expanduser(), dtype=dtype, device=device, tier=tier, progress=progress,
                                 stream_options=stream_options, compute_dtype=compute_dtype)
    path = check_model_folder(prepare_builtin(path, progress), "target")
    load_config(path, "target")
    total = _folder_bytes(path)
    streamed = streams(tier, device)
    compute_dtype = resolve_compute_dtype(dtype, compute_dtype, device, streamed)
    if compute_dtype is not None and compute_dtype != dtype:
        if streamed and dtype == torch.bfloat16 and compute_dtype == torch.float32 \
                and stream_options.get("quant", "none") == "none":
            stream_options = {**stream_options, "quant": "bf16"}  # bf16 bytes per pass, float32 math
        dtype = compute_dtype
    if progress:
        progress(LoadProgress("target", tier, 0, total, "loading"))
    if streamed:
        from minions_local.offload.streamed import load_streamed_causal_lm

        model, stats = load_streamed_causal_lm(path, tier=tier, dtype=dtype, device=device, progress=progress,
                                               **stream_options)
        target = exact_target(model, bytes_streamed=lambda: stats.bytes_streamed)
        target.stream_stats = stats
    else:
        target = exact_target(load_causal_lm(path, "target", dtype, device))
    if progress:
        progress(LoadProgress("target", tier, total, total, "ready"))
    tokenizer = load_tokenizer(path, "target")
    if tokenizer is not None and len(tokenizer) > target.vocab_size:
        raise ModelLoadError(f"The tokenizer in {path} has {len(tokenizer)} tokens but the model's embedding has "
                             f"only {target.vocab_size} rows: they do not belong together. Restore the tokenizer "
                             f"files that came with these weights.")
    return target, tokenizer


def is_gguf_path(path: str | Path) -> bool:
    """A target given as a GGUF file (by its name: a missing one is named by the loader)."""
    return str(path).lower().endswith(".gguf")


def _load_gguf_target(path: Path, *, dtype: torch.dtype | None, device: str, tier: str, progress: Progress | None,
                      stream_options: dict[str, Any], compute_dtype: torch.dtype | str | None) -> tuple[HFTarget, Any]:
    """A GGUF file as the target: its layers stream as their own blocks and are
    dequantized into the compute dtype as each runs (offload/gguf_streamed.py); on the
    device tier they are dequantized once. The weights are the GGUF's, so the compute
    dtype defaults to float32 (exactly those weights); a 16-bit one rounds them once."""
    from minions_local.models.builtin import SMOLLM2_GGUF, builtin_name
    from minions_local.offload.gguf_streamed import load_streamed_gguf

    if builtin_name(path) == SMOLLM2_GGUF:
        from minions_local.models.smollm2 import shipped_gguf

        path = shipped_gguf()  # checked; a missing wheel is named with what to install
    if runs_on_llama_cpp(device, stream_options.get("kernel", "auto")):
        from minions_local.backends.llama_load import load_llama_target
        from minions_local.speculation.calibration import time_lone_pass, time_pass_shape

        return load_llama_target(path, context_tokens=stream_options.get("context_tokens", 4096),
                                 layer_tiers=stream_options.get("layer_tiers"), window=stream_options.get("buffers", 2),
                                 progress=progress, rpc=stream_options.get("rpc"), time_shape=time_pass_shape,
                                 time_lone=time_lone_pass)
    if stream_options.get("rpc"):
        raise ModelLoadError(f"Splitting a target over RPC servers runs it on llama.cpp, on a CPU; this one is set "
                             f"to run on {device} with gguf_kernel '{stream_options.get('kernel')}'.")
    streamed = streams(tier, device)
    compute = resolve_compute_dtype(dtype or torch.float32, compute_dtype, device, streamed) or torch.float32
    options = {k: v for k, v in stream_options.items()
               if k != "context_tokens" and (k != "quant" or v not in ("none", "gguf"))}
    if not streamed:
        options = {k: v for k, v in options.items() if k == "cache_dir"}
    from minions_local.backends.compact import supports

    model, stats = load_streamed_gguf(path, tier=tier if streamed else "device", dtype=compute, device=device,
                                      progress=progress, runs_int4=supports, **options)
    if streamed:
        target = exact_target(model, bytes_streamed=lambda: stats.bytes_streamed)
        target.stream_stats = stats
    else:
        target = exact_target(model)
    from minions_local.models.gguf_target import side_folder

    return target, load_tokenizer(side_folder(path), "target")


def runs_on_llama_cpp(device: str, kernel: str) -> bool:
    """Whether a GGUF target computes on llama.cpp (planning.memory_plan.gguf_on_llama_cpp)."""
    from minions_local.planning.memory_plan import gguf_on_llama_cpp

    if kernel == "llama.cpp" and device != "cpu":
        raise ModelLoadError(f"gguf_kernel = 'llama.cpp' runs the target on the CPU; this one is set to run on "
                             f"{device}. Use gguf_kernel = 'auto' there.")
    return gguf_on_llama_cpp(kernel, device)


def load_minion(spec: Any, *, index: int, target_path: Path, target_tokenizer, target_vocab: int,
                dtype: torch.dtype | None, device: str, progress: Progress | None,
                target: Any = None) -> BaseMinion:
    """A minion from a spec: an HF folder, a .gguf file, 'ngram', 'eagle[:FILE]', a
    MinionSpec, or a ready Minion object (one of a user's own is wrapped to answer the
    capabilities it lacks: core/minion.py). `target`: the loaded target (a feature
    drafter reads its features and shares its embeddings)."""
    if isinstance(spec, (BaseMinion, Minion)) and not isinstance(spec, (str, Path)):
        return as_minion(spec)
    options = spec if isinstance(spec, MinionSpec) else MinionSpec(str(spec))
    from minions_local.models.drafter import weights_named

    short = weights_named(options.path)
    if options.kind == "eagle" or short is not None:
        minion = _load_feature_drafter(options.path if short is None else short, options.name, target_path,
                                       target, progress)
    else:
        minion = _load_minion(options, index=index, target_path=target_path, target_tokenizer=target_tokenizer,
                              target_vocab=target_vocab, dtype=resolve_dtype(options.dtype) or dtype,
                              device=options.device or device, progress=progress)
    if options.name:
        minion.name = options.name
    return minion


def prepare_builtin(path: str | Path, progress: Progress | None) -> Path:
    """A built-in model's folder, converted on first use (checked against its manifest)."""
    from minions_local.models.builtin import SMOLLM2, builtin_name

    if builtin_name(path) == SMOLLM2:
        from minions_local.models.smollm2 import ensure_folder

        return ensure_folder(progress)
    return Path(path).expanduser()


def _load_minion(spec: MinionSpec, *, index: int, target_path: Path, target_tokenizer, target_vocab: int,
                 dtype: torch.dtype | None, device: str, progress: Progress | None) -> BaseMinion:
    text = spec.path
    if spec.kind == "substitute":
        minion = _load_substitute(spec, progress, device)
        check_vocabulary(target_path, target_tokenizer, target_vocab, minion.path, None, minion.vocab_size)
        return minion
    if spec.kind == "self_draft":
        from minions_local.backends.self_draft import load_self_draft

        if spec.layers is None:
            raise ModelLoadError(f"The self-draft minion {index} needs 'layers' (how many of the target's first "
                                 f"layers it runs).")
        folder = prepare_builtin(text, progress)
        name = spec.name or f"self-draft-{spec.layers}"
        if progress:
            progress(LoadProgress(name, "device", 0, 1, f"loading the target's first {spec.layers} layers"))
        minion = load_self_draft(folder, spec.layers, dtype=dtype, device=device, name=name)
        if progress:
            progress(LoadProgress(name, "device", 1, 1, "ready"))
        return minion
    if text == "ngram" or text.startswith("ngram:"):
        from minions_local.backends.ngram import NGramMinion

        encode = None
        if target_tokenizer is not None:
            encode = lambda s: target_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
        return NGramMinion.from_spec(text, encode=encode)
    if text.endswith(".gguf"):
        from minions_local.backends.gguf import GGUFMinion

        tokens = model_tokens(text)  # from its header: a minion off the target's vocabulary is not loaded at all
        if tokens is not None:
            check_vocabulary(target_path, target_tokenizer, target_vocab, Path(text), tokens, len(tokens))
        first = shard_paths(text)[0]  # llama.cpp loads a split model from its first shard only
        minion = GGUFMinion.from_path(first, n_gpu_layers=gguf_gpu_layers(device, text))
        if tokens is None:
            check_vocabulary(target_path, target_tokenizer, target_vocab, Path(text), None, minion.vocab_size)
        return minion
    path = check_model_folder(prepare_builtin(text, progress), f"minion {index}")
    config = load_config(path, f"minion {index}")
    check_vocabulary(target_path, target_tokenizer, target_vocab, path, load_tokenizer(path, "minion"),
                     int(config.vocab_size))
    total = _folder_bytes(path)
    if progress:
        progress(LoadProgress(path.name, "device", 0, total, "loading"))
    model = load_causal_lm(path, f"minion {index}", dtype, device, quantization=spec.quantization)
    minion = HFMinion(model, name=path.name, release_weights=True)
    if progress:
        progress(LoadProgress(path.name, "device", total, total, "ready"))
    return minion


def _load_feature_drafter(path: str, name: str | None, target_path: Path, target: Any,
                          progress: Progress | None) -> BaseMinion:
    """A feature drafter on the loaded target's embeddings, head and features."""
    from minions_local.backends.eagle import FeatureMinion, FeatureRunner
    from minions_local.models import drafter
    from minions_local.models.builtin import SMOLLM2, builtin_name

    if target is None or not hasattr(target, "features_of"):
        raise ModelLoadError("A feature drafter ('eagle') reads the target's hidden states: load it with the "
                             "engine's own target (Engine.from_pretrained or a profile).")
    if path:
        weights = Path(path).expanduser()
    elif builtin_name(target_path) == SMOLLM2:
        weights = drafter.trained_path()
    else:
        raise ModelLoadError(f"An 'eagle' minion for {target_path} needs the path of a weights file trained for "
                             f"it (scripts/train_drafter.py trains one for the built-in SmolLM2).")
    name = name or "eagle"
    if progress:
        progress(LoadProgress(name, "device", 0, 1, "joining the feature drafter to the target"))
    model, fc = drafter.build_drafter(target.model, weights)
    minion = FeatureMinion(FeatureRunner(model, fc), target, name)
    if progress:
        progress(LoadProgress(name, "device", 1, 1, "ready"))
    return minion


def _load_substitute(spec: MinionSpec, progress: Progress | None, device: str) -> BaseMinion:
    """The target re-quantized by llama.cpp (made once into the cache), as a GGUF minion."""
    from minions_local.backends.gguf import GGUFMinion, import_llama_cpp
    from minions_local.backends.substitute import substitute_gguf
    from minions_local.models.builtin import SMOLLM2, SMOLLM2_GGUF, builtin_name, models_cache

    path = Path(spec.path).expanduser()
    if builtin_name(path) in (SMOLLM2, SMOLLM2_GGUF):  # both made from the wheel's GGUF
        from minions_local.models.smollm2 import shipped_gguf

        source, stem = shipped_gguf(), SMOLLM2
    elif path.suffix == ".gguf" and path.is_file():
        source, stem = path, f"substitutes/{path.stem}"
    else:
        raise ModelLoadError(f"A 'substitute' minion re-quantizes a GGUF of the target, and {path} is not a .gguf "
                             f"file. Export one (scripts/export_gguf.py) and set the minion's path to it.")
    try:
        import_llama_cpp()
    except ModelLoadError as err:
        raise ModelLoadError(f"The minion '{spec.name or spec.quantization}' is the target re-quantized by "
                             f"llama.cpp. {err} `bash scripts/setup.sh` builds and installs it once (3-5 minutes). "
                             f"Or run without it: --minion ngram, or the 'stdlib-demo' profile.") from None
    name = spec.name or spec.quantization
    file = substitute_gguf(source, spec.quantization, models_cache() / f"{stem}.{spec.quantization}.gguf",
                           name=name, progress=progress)
    return GGUFMinion.from_path(file, name=name, n_gpu_layers=gguf_gpu_layers(device, name))


def gguf_gpu_layers(device: str, name: str) -> int:
    """llama.cpp layers to offload: all of them for a CUDA minion, which needs a CUDA
    build of llama-cpp-python (a CPU build would silently draft on the CPU instead)."""
    if device != "cuda":
        return 0
    from minions_local.backends.gguf import import_llama_cpp

    if not import_llama_cpp().llama_supports_gpu_offload():
        raise ModelLoadError(f"The minion '{name}' is set to run on CUDA, but this llama-cpp-python was built "
                             f"without GPU support. Build and install a CUDA one: EXTRA_CMAKE_ARGS='-DGGML_CUDA=ON' "
                             f"PYTHON=.venv/bin/python bash scripts/build_llama_cpp_wheel.sh; or set the "
                             f"minion's device = \"cpu\".")
    return 999  # every layer (llama.cpp clamps it to the model's count)


def check_vocabulary(target_path: Path, target_tok, target_vocab: int, minion_path: Path, minion_tok,
                     minion_vocab: int) -> None:
    """A minion must speak the target's vocabulary, or its drafts mean nothing.

    Two tokenizers compare their trained vocabularies. A GGUF minion's token list (read
    from its metadata: `minion_tok` a list) compares id by id with the target's whole
    vocabulary, and the embeddings' rows must agree: two families may share a
    vocabulary's size and nothing else."""
    detail = ""
    if target_tok is not None and minion_tok is not None and not isinstance(minion_tok, list):
        t_vocab, m_vocab = _base_vocab(target_tok), _base_vocab(minion_tok)
        t_size, m_size = len(t_vocab), len(m_vocab)
        same = t_vocab == m_vocab
    else:
        t_size = len(target_tok) if target_tok is not None else target_vocab
        m_size = minion_vocab
        same = target_vocab == minion_vocab
        t_list, m_list = _token_list(target_tok), _token_list(minion_tok)
        if same and t_list is not None and m_list is not None:
            detail = tokens_differ(t_list, m_list, padded=True)
            same = not detail
    if not same:
        raise mismatch(target_path, t_size, minion_path, m_size, detail)


def _token_list(tokens) -> list[str] | None:
    """Token text by id: a list as it is (a GGUF's metadata), else a tokenizer's whole
    vocabulary (added tokens included; None where its ids leave gaps)."""
    if tokens is None or isinstance(tokens, list):
        return tokens
    by_id = {i: t for t, i in tokens.get_vocab().items()}
    return [by_id[i] for i in range(len(by_id))] if set(by_id) == set(range(len(by_id))) else None


def _base_vocab(tokenizer) -> dict[str, int]:
    """Token -> id of the trained vocabulary. Tokenizer classes add their own special
    tokens on load (a Qwen2 class adds one to the same tokenizer.json), which says
    nothing about whether the ids mean the same text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.get_vocab(with_added_tokens=False)
    base = getattr(tokenizer, "base_vocab", None)  # a llama.cpp target's (backends/llama_vocab.py)
    return base() if base is not None else tokenizer.get_vocab()


def unique_names(minions: list[BaseMinion]) -> None:
    seen: dict[str, int] = {}
    for m in minions:
        n = seen.get(m.name, 0)
        seen[m.name] = n + 1
        if n:
            m.name = f"{m.name}#{n + 1}"


class PolicyAdapter(BudgetPolicy):
    """A budget policy that does not inherit BudgetPolicy (a user's own): its own
    members where it has them, BudgetPolicy's defaults where it does not."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["policy"], name)

    @property
    def uses_timed_passes(self) -> bool:  # type: ignore[override]
        # One with a calibrate of its own was always given the timed passes.
        return getattr(self.policy, "uses_timed_passes", callable(getattr(self.policy, "calibrate", None)))

    def choose(self, remaining_tokens: int, regime: str = "greedy") -> StepBudget:
        return self.policy.choose(remaining_tokens, regime=regime)

    def observe(self, record: StepRecord) -> None:
        self.policy.observe(record)

    def plan(self, asks: Sequence[TreeAsk | tuple]) -> list[StepBudget]:
        own = getattr(self.policy, "plan", None)
        return own(asks) if own is not None else super().plan(asks)

    def observe_pass(self, record: PassRecord) -> None:
        if (own := getattr(self.policy, "observe_pass", None)) is not None:
            own(record)
        else:
            super().observe_pass(record)

    def price_batch_grows(self, groups: dict[str, int]) -> None:
        if (own := getattr(self.policy, "price_batch_grows", None)) is not None:
            own(groups)

    def calibrate(self, grow_samples: dict[str, list[tuple[int, float]]],
                  verify_samples: Sequence[tuple[int, float]] = ()) -> None:
        if (own := getattr(self.policy, "calibrate", None)) is not None:
            own(grow_samples, verify_samples)


def as_policy(policy: Any) -> BudgetPolicy:
    """`policy` itself when it inherits BudgetPolicy, else wrapped to answer what it lacks."""
    return policy if isinstance(policy, BudgetPolicy) else PolicyAdapter(policy)


__all__ = ["load_target", "load_minion", "check_vocabulary", "unique_names", "as_policy", "ModelLoadError"]
