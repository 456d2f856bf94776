"""The decoding methods the benchmark compares, each behind one `run()`.

Every method decodes token ids -> token ids from a cold cache (prefill included in
its time, since transformers and llama.cpp cannot report theirs apart), sets its own
CPU thread count first, and counts the target's forward passes that produced tokens.

- EngineMethod: our engine (autoregressive with no minions, a chain, fixed budgets,
  the profile's adaptive policy); engines share one loaded target so every variant
  streams the same layers from the same tier.
- HFMethod: transformers `generate`, plain or assisted (`assistant_model=`), resident
  or with accelerate disk offload.
- LlamaCppMethod: llama-cpp-python on the target exported to GGUF, with or without
  its prompt-lookup draft.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minions_local import Engine
from minions_local.core.events import StepRecord
from minions_local.speculation.budget import BudgetPolicy
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

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Method:
    name: str
    family: str
    """'autoregressive' | 'transformers' | 'chain' | 'fixed' | 'adaptive' | 'llama.cpp'."""
    threads: int
    detail: str = ""
    """What else was chosen (dtype, schedule, weight type), for the report."""

    def run(self, ids: list[int], max_new: int, temperature: float, seed: int) -> Run:
        raise NotImplementedError

    def variant(self, **changes: Any) -> "Method":
        """A copy sharing the loaded models (threads are set per call, so they can differ)."""
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(changes)
        return copy


class EngineMethod(Method):
    def __init__(self, name: str, family: str, engine: Engine, threads: int, detail: str = "") -> None:
        super().__init__(name, family, threads, detail)
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
        start = time.perf_counter()
        out = self.engine.generate(ids, max_new_tokens=max_new, temperature=temperature)
        seconds = time.perf_counter() - start
        return Run(list(out.token_ids), seconds, len(out.steps), list(out.steps), out.prefill_seconds)


def engine_sharing_target(base: Engine, minions: list, policy: BudgetPolicy, selection: str = "learned") -> Engine:
    """An engine over `base`'s already loaded target (same tier, dtype, stream options)."""
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
    def __init__(self, name: str, model, threads: int, *, assistant=None, eos_id: int | None = None,
                 detail: str = "", before_pass=None) -> None:
        super().__init__(name, "transformers", threads, detail)
        self.model = model
        self.assistant = assistant
        self.eos_id = eos_id
        self.counter = _PassCounter(model)
        if before_pass is not None:
            model.register_forward_pre_hook(lambda _m, _a: before_pass())

    def run(self, ids: list[int], max_new: int, temperature: float, seed: int) -> Run:
        torch.set_num_threads(self.threads)
        torch.manual_seed(seed)
        input_ids = torch.tensor([ids])
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
            else dict(do_sample=False)
        extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
        before = self.counter.count
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new,
                                      pad_token_id=self.eos_id, eos_token_id=self.eos_id, **sampling, **extra)
        seconds = time.perf_counter() - start
        return Run(out[0, len(ids):].tolist(), seconds, self.counter.count - before)


def load_hf(path: Path, dtype: torch.dtype, *, offload_folder: Path | None = None):
    """A transformers model, resident, or with its decoder layers offloaded to disk by accelerate."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if offload_folder is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    layers = AutoConfig.from_pretrained(path).num_hidden_layers
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" for i in range(layers)})
    offload_folder.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map,
                                                 offload_folder=str(offload_folder))
    return model.eval()


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
    def __init__(self, name: str, gguf: Path, threads: int, *, prompt_lookup: bool, n_ctx: int,
                 detail: str = "") -> None:
        super().__init__(name, "llama.cpp", threads, detail)
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding() if prompt_lookup else None  # its defaults: 2-gram, 10 tokens
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         draft_model=draft, verbose=False)
        self.eos_id = self.llm.token_eos()
        self.passes = 0
        evaluate = self.llm.eval

        def counting_eval(tokens):
            self.passes += 1
            return evaluate(tokens)

        self.llm.eval = counting_eval  # generate() calls self.eval once per pass

    def variant(self, **changes: Any) -> "Method":
        raise NotImplementedError("llama.cpp fixes its thread count when loading: build another instance")

    def run(self, ids: list[int], max_new: int, temperature: float, seed: int) -> Run:
        self.llm.reset()
        self.llm.set_seed(seed)
        self.passes = 0
        out: list[int] = []
        start = time.perf_counter()
        # top_k 0 / top_p 1 / min_p 0: sample from the plain tempered distribution, like the others.
        for token in self.llm.generate(ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            out.append(token)
            if token == self.eos_id or len(out) >= max_new:
                break
        seconds = time.perf_counter() - start
        return Run(out, seconds, self.passes)
