"""The decoding methods the benchmark compares, each behind one `run()`.

Every method decodes token ids -> token ids from a cold cache (prefill included in
its time, since transformers and llama.cpp cannot report theirs apart), sets its own
CPU thread count first, counts the target's forward passes that produced tokens, and
the bytes its process read from storage meanwhile (/proc/self/io).

- EngineMethod: our engine (autoregressive with no minions, fixed tree sizes, the
  profile's adaptive policy, with learned selection or all minions); engines of one
  dtype share one loaded target, so every variant streams the same layers from the
  same tier.
- HFMethod: transformers `generate`, plain or assisted (`assistant_model=`, or
  `prompt_lookup_num_tokens=`), resident or with accelerate disk offload.
- LlamaCppMethod: llama-cpp-python in a child process (llama_child.py), with or
  without its prompt-lookup draft.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.llama_child import LlamaCppServer, proc_io_bytes
from minions_local import Engine
from minions_local.core.events import StepRecord
from minions_local.speculation.budget import BudgetPolicy
from minions_local.speculation.calibration import calibrate_policy
from minions_local.speculation.decode import Decoder


@dataclass
class Run:
    """One generation by one method."""

    tokens: list[int]
    seconds: float
    """Wall time of the whole call, prefill included."""
    passes: int
    """Target forward passes that produced tokens (the prompt-only prefill of our engine is not one)."""
    steps: list[StepRecord] = field(default_factory=list)
    """Our engine's step records (empty for other methods)."""
    prefill_seconds: float = 0.0
    """Our engine's prompt pass (0 for other methods: they cannot report it apart)."""
    read_bytes: int = 0
    """Bytes the method's process read from storage during the call (page cache hits not counted)."""
    streamed_bytes: int = 0
    """Our engine's target weight bytes streamed during the call, prefill included (0 for others)."""

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Method:
    name: str
    family: str
    """'autoregressive' | 'fixed' | 'adaptive' | 'adaptive-all' | 'transformers' | 'llama.cpp'."""
    threads: int
    detail: str = ""
    """What else was chosen (dtype, schedule, weight type), for the report."""
    dtype: str = ""
    """The compute dtype or weight type this candidate runs in."""
    weight_bytes: int = 0
    """The target weights one pass reads, wherever they are (what a RAM-tier pass reads)."""

    def run(self, ids: list[int], max_new: int, temperature: float, seed: int) -> Run:
        raise NotImplementedError

    def variant(self, **changes: Any) -> "Method":
        """A copy sharing the loaded models (threads are set per call, so they can differ)."""
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(changes)
        return copy


class EngineMethod(Method):
    def __init__(self, name: str, family: str, engine: Engine, threads: int, detail: str = "", *,
                 dtype: str = "", weight_bytes: int = 0) -> None:
        super().__init__(name, family, threads, detail, dtype, weight_bytes)
        self.engine = engine
        # The tree snapshot is for the TUI's tree view; an API caller does not pay for it.
        engine.decoder.keep_trees = False

    def run(self, ids: list[int], max_new: int, temperature: float, seed: int) -> Run:
        torch.set_num_threads(self.threads)
        self.engine.reset()  # a cold cache, like every other method gets
        # Unseeded, like the chat: a seeded request keeps fixed drafts so that it repeats
        # exactly, which accepts less when sampling. Seeding Python's RNG instead makes
        # the request's own random stream (and so this run) repeatable.
        random.seed(seed)
        target = self.engine.decoder.target
        streamed, read = target.bytes_streamed(), proc_io_bytes()
        start = time.perf_counter()
        out = self.engine.generate(ids, max_new_tokens=max_new, temperature=temperature)
        seconds = time.perf_counter() - start
        return Run(list(out.token_ids), seconds, len(out.steps), list(out.steps), out.prefill_seconds,
                   read_bytes=proc_io_bytes() - read, streamed_bytes=target.bytes_streamed() - streamed)


def engine_sharing_target(base: Engine, minions: list, policy: BudgetPolicy, selection: str = "learned") -> Engine:
    """An engine over `base`'s already loaded target (same tier, dtype, stream options)."""
    calibrate_policy(policy, minions, base.decoder.target.vocab_size,  # as Engine.from_pretrained does
                     target=base.decoder.target)
    decoder = Decoder(base.decoder.target, list(minions), policy, top_k=base.decoder.top_k, selection=selection)
    return Engine(decoder, base.tokenizer, profile_name=base.profile_name, memory_plan=base.memory_plan)


class _PassCounter:
    """Counts calls of a module's forward (one per target pass in `generate`)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.count = 0
        module.register_forward_pre_hook(self._hook)

    def _hook(self, _module, _args) -> None:
        self.count += 1


class HFMethod(Method):
    def __init__(self, name: str, model, threads: int, *, assistant=None, prompt_lookup: int = 0,
                 eos_id: int | None = None, detail: str = "", dtype: str = "", before_pass=None) -> None:
        super().__init__(name, "transformers", threads, detail, dtype, param_bytes(model))
        self.model = model
        self.assistant = assistant
        self.prompt_lookup = prompt_lookup
        self.eos_id = eos_id
        self.counter = _PassCounter(model)
        if before_pass is not None:
            model.register_forward_pre_hook(lambda _m, _a: before_pass())

    def run(self, ids: list[int], max_new: int, temperature: float, seed: int) -> Run:
        torch.set_num_threads(self.threads)
        torch.manual_seed(seed)
        input_ids = torch.tensor([ids], device=self.model.get_input_embeddings().weight.device)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
            else dict(do_sample=False)
        extra: dict[str, Any] = {}
        if self.assistant is not None:
            extra["assistant_model"] = self.assistant
        if self.prompt_lookup:
            extra["prompt_lookup_num_tokens"] = self.prompt_lookup
        before, read = self.counter.count, proc_io_bytes()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new,
                                      pad_token_id=self.eos_id, eos_token_id=self.eos_id, **sampling, **extra)
        seconds = time.perf_counter() - start
        return Run(out[0, len(ids):].tolist(), seconds, self.counter.count - before,
                   read_bytes=proc_io_bytes() - read)


def param_bytes(model) -> int:
    """Bytes of a model's weights in their compute dtype (offloaded ones included: the
    meta-device placeholders keep their shape and dtype)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:  # tied embeddings count once
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def load_hf(path: Path, dtype: torch.dtype, *, offload_folder: Path | None = None, layers: int | None = None,
            device: str = "cpu", layers_on: str | None = None):
    """A transformers model, resident, or with its decoder layers offloaded by
    accelerate: to disk (layers_on="disk", into offload_folder), or on a CUDA device to host
    RAM (layers_on="cpu": accelerate copies each layer to the GPU as it runs, the peer
    of our RAM tier). layers=K: only the first K decoder layers, then the model's own
    final norm and head (a truncated copy of the model, built from its own weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    options: dict[str, Any] = {"dtype": dtype}
    if layers is not None:
        options["num_hidden_layers"] = layers
    compute = 0 if device == "cuda" else "cpu"
    if layers_on is not None:
        count = AutoConfig.from_pretrained(path).num_hidden_layers if layers is None else layers
        device_map: dict[str, Any] = {name: compute for name in
                                      ("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head")}
        device_map.update({f"model.layers.{i}": layers_on for i in range(count)})
        options["device_map"] = device_map
        if offload_folder is not None:
            offload_folder.mkdir(parents=True, exist_ok=True)
            options["offload_folder"] = str(offload_folder)
    elif device == "cuda":
        options["device_map"] = {"": 0}
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a truncated copy lists every skipped layer tensor as UNEXPECTED
    try:
        return AutoModelForCausalLM.from_pretrained(path, **options).eval()
    finally:
        hf_logging.set_verbosity(level)


def page_cache_dropper(*folders: Path):
    """A callable that evicts the folders' weight files from the page cache. Called
    before each target pass so accelerate reads its offloaded layers from disk, as our
    disk tier does (O_DIRECT), instead of from RAM. accelerate offloads a safetensors
    checkpoint by pointing at the checkpoint's own files (the offload folder stays
    empty), so the checkpoint folder is one of the folders."""
    files = sorted(p for folder in folders for pattern in ("*.safetensors", "*.dat") for p in folder.rglob(pattern))

    def drop() -> None:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    return drop


class LlamaCppMethod(Method):
    """One (threads, prompt lookup) variant served by a llama.cpp child."""

    def __init__(self, name: str, server: LlamaCppServer, threads: int, *, prompt_lookup: bool,
                 detail: str = "", dtype: str = "") -> None:
        super().__init__(name, "llama.cpp", threads, detail, dtype, server.file_bytes)
        self.server = server
        self.prompt_lookup = prompt_lookup

    def run(self, ids: list[int], max_new: int, temperature: float, seed: int) -> Run:
        out = self.server.run(self.threads, self.prompt_lookup, ids, max_new, temperature, seed)
        return Run(out["tokens"], out["seconds"], out["passes"], read_bytes=out["read_bytes"])
