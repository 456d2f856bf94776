"""The peers bench_batch.py serves N concurrent chat requests with (issue 24), each
decoding all N at once, behind the same `run()` as batch_methods.py's methods:

- transformers batch: `generate` on the N prompts left-padded into one batch (attention
  mask; positions follow the mask), the target's decoder layers offloaded to disk by
  accelerate on the disk tier (their page cache dropped before every pass, from a
  private copy of the checkpoint, as bench.py's transformers peers), resident on the
  RAM tier. It computes in the engine's math dtype (bf16 where the CPU has bf16
  matmuls, else float32 from the bf16 weights), so its greedy replies are the target's
  own up to near-ties. A streamer notes the time of every step, so a request's first
  token and its last (its eos, or max_new) are timed where they were made, not when
  `generate` returns.
- llama.cpp batch: a child process (llama_child.py) decoding the N sequences with
  llama.cpp's batch API: the prompts in one batch, then one llama_decode per step with
  one token per running sequence (seq_id = request index, a KV stream each; n_seq_max =
  the run's largest concurrency). Greedy is argmax per row; sampled draws from
  softmax(logits / temperature) with numpy; a row stops at eos or max_new. On the
  shipped Q4_1 GGUF for SmolLM2, an f32 export of any other target (the stand-ins).
  In RAM, and on the disk tier also in a memory group smaller than the model with the
  page cache dropped before each run (memlimit.py), as bench.py's llama.cpp peer, on a
  private copy of the file (the in-RAM child's mapped pages would otherwise serve it).

What cannot run here (no llama-cpp-python, no accelerate for the disk tier, no memory
group, a model llama.cpp will not load) is left out with a note, never an error.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import time
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from benchmarks.batch_methods import BatchResult, RequestTiming
from benchmarks.chat_prompts import CHAT_PROMPTS, calibration_prompt, chat_prompts
from benchmarks.choices import resolve_tier
from benchmarks.lineup import HF_OFFLOAD_DIR, private_copy
from benchmarks.llama_child import LlamaCppBatchServer, MethodFailed
from benchmarks.memlimit import MemoryGroup, NoMemoryGroup, group_name
from benchmarks.methods import load_hf, page_cache_dropper
from minions_local.offload.dtypes import dtype_name

LLAMA_MEMORY_SHARE = 0.5
"""Share of the GGUF the memory group may keep cached: bench.py's --llama-cpp-cache-share default."""
PRIVATE_GGUF_DIR = Path("~/.cache/minions-local/bench-batch").expanduser()
"""Where the memory-limited llama.cpp child's own copy of a shipped GGUF is kept between runs."""


def peer_methods(engine, *, profile: str, max_new: int, most: int, notes: list[str], workdir: Path) -> list:
    """The peers that can run here, serving the engine's target as `profile` places it
    (its tier), for up to `most` requests of up to `max_new` new tokens at once."""
    tier = resolve_tier(profile, None)
    target = _target_folder(engine, profile)
    eos = sorted(int(t) for t in engine.eos_ids)
    peers = _transformers(engine, target, tier, eos, notes, workdir)
    return peers + _llama_cpp(engine, target, tier, eos, max_new, most, notes, workdir)


class TransformersBatch:
    """transformers `generate` on one left-padded batch of the N prompts."""

    def __init__(self, name: str, model, *, eos_ids: list[int], pad_id: int) -> None:
        self.name = name
        self.model = model
        self.eos_ids = eos_ids
        self.pad_id = pad_id

    def run(self, prompts: list[list[int]], max_new: int, temperature: float, seed: int) -> BatchResult:
        torch.manual_seed(seed)
        width = max(map(len, prompts))
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            mask[row, width - len(ids):] = 1
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
            else dict(do_sample=False)
        start = time.perf_counter()
        steps = _StepTimes(start)
        with torch.inference_mode():
            out = self.model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=0,
                                      eos_token_id=self.eos_ids, pad_token_id=self.pad_id, streamer=steps,
                                      **sampling)
        wall = time.perf_counter() - start
        eos = set(self.eos_ids)
        timings = []
        for row in out[:, width:].tolist():
            # A row's reply ends at its eos (kept, as our engine keeps it); pads follow it.
            count = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            timings.append(RequestTiming(row[:count], steps.times[0], steps.times[count - 1]))
        return BatchResult(timings, wall)


class _StepTimes(BaseStreamer):
    """When each step's tokens came (seconds from `start`): generate puts the prompt
    first, then every step's new token of every row."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.times: list[float] = []
        self._prompt = True

    def put(self, value) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.times.append(time.perf_counter() - self.start)

    def end(self) -> None:
        pass


class LlamaCppBatch:
    """N sequences in one llama.cpp batch, in a child process (llama_child.py)."""

    def __init__(self, name: str, server: LlamaCppBatchServer, *, eos_ids: list[int], notes: list[str]) -> None:
        self.name = name
        self.server = server
        self.eos_ids = eos_ids
        self.notes = notes
        self.read_bytes = 0
        self.passes = 0
        self._closed = False

    def run(self, prompts: list[list[int]], max_new: int, temperature: float, seed: int) -> BatchResult:
        out = self.server.run_batch(prompts, max_new, temperature, seed, self.eos_ids)
        self.read_bytes += out["read_bytes"]
        self.passes += out["passes"]
        timings = [RequestTiming(t, first, done) for t, first, done in zip(out["tokens"], out["first"], out["done"])]
        return BatchResult(timings, out["seconds"])

    def close(self) -> None:
        """Ends the child and removes its memory group; says what it read from disk."""
        if self._closed:
            return
        self._closed = True
        self.server.close(self.notes)
        if self.server.disk and self.passes:
            self.notes.append(f"{self.name}: {self.read_bytes / self.passes / 1e6:.1f} MB read from disk per "
                              f"llama_decode ({self.passes} of them; the file is "
                              f"{self.server.file_bytes / 1e6:.1f} MB)")


def _target_folder(engine, profile: str) -> Path:
    """The HF folder the engine's target was loaded from (a built-in one converted)."""
    config = getattr(engine.decoder.target.model, "config", None)
    path = Path(getattr(config, "_name_or_path", "") or "")
    if str(path) and (path / "config.json").is_file():
        return path
    from minions_local.engine.loading import prepare_builtin
    from minions_local.profile import load_profile

    return prepare_builtin(load_profile(profile).target.path, None)


def _math_dtype(engine) -> torch.dtype:
    plan = getattr(engine, "memory_plan", None)
    name = getattr(plan, "math_dtype", None)
    return getattr(torch, name) if name else engine.decoder.target.model.dtype


def _transformers(engine, target: Path, tier: str, eos: list[int], notes: list[str], workdir: Path) -> list:
    if tier == "disk" and not _installed("accelerate"):
        notes.append("transformers batch skipped: accelerate is not installed (its disk offload is the "
                     "disk tier's peer)")
        return []
    dtype = _math_dtype(engine)
    pad = engine.tokenizer.pad_token_id
    pad = eos[0] if pad is None else int(pad)
    try:
        if tier != "disk":
            model = load_hf(target, dtype)
            return [TransformersBatch("transformers batch", model, eos_ids=eos, pad_id=pad)]
        # Stand-ins live in the run's folder: their offload copies go there too.
        root = workdir / "hf-offload" if target.is_relative_to(workdir) else HF_OFFLOAD_DIR
        checkpoint = private_copy(target, root / f"{target.name}-checkpoint")
        # Its own offload folder: accelerate rewrites one at every load, and bench.py may be reading its own.
        offload = root / f"{target.name}-batch-{dtype_name(dtype)}"
        model = load_hf(checkpoint, dtype, offload_folder=offload, layers_on="disk")
    except ImportError as err:
        notes.append(f"transformers batch skipped: {err}")
        return []
    drop = page_cache_dropper(offload, checkpoint)
    model.register_forward_pre_hook(lambda _m, _a: drop())
    notes.append(f"transformers batch: {dtype_name(dtype)}, decoder layers offloaded to disk by accelerate from a "
                 f"private copy of the checkpoint ({offload}); their page cache dropped before every pass")
    return [TransformersBatch("transformers batch", model, eos_ids=eos, pad_id=pad)]


def _llama_cpp(engine, target: Path, tier: str, eos: list[int], max_new: int, most: int, notes: list[str],
               workdir: Path) -> list:
    if not _installed("llama_cpp"):
        notes.append("llama.cpp batch skipped: llama-cpp-python is not installed (scripts/setup.sh installs it)")
        return []
    try:
        gguf, kind = _gguf(target, workdir)
    except Exception as err:  # noqa: BLE001 - no shipped file, an export llama.cpp's format refuses: skip it
        notes.append(f"llama.cpp batch skipped: no GGUF of the target: {err}")
        return []
    tokenizer = engine.tokenizer
    warm = calibration_prompt(tokenizer).ids
    longest = max(len(ids) for ids in [warm, *(p.ids for p in chat_prompts(tokenizer, len(CHAT_PROMPTS)))])
    cells = longest + max_new + 64
    threads = torch.get_num_threads()
    variants = [("llama.cpp batch", None)]
    if tier == "disk":
        variants.append(("llama.cpp batch memlimit", LLAMA_MEMORY_SHARE))
    peers = []
    for name, share in variants:
        why = _no_memory_group() if share is not None else None
        if why:
            notes.append(f"{name} skipped: {why}")
            continue
        try:
            server = LlamaCppBatchServer(gguf if share is None else _private_gguf(gguf, workdir), threads=threads,
                                         sequences=most, n_ctx=cells, warm_ids=warm, memory_share=share,
                                         tag="batch-limit" if share else "batch-ram", notes=notes)
        except (MethodFailed, OSError) as err:  # a child that died loading, no room for the copy
            notes.append(f"{name} skipped: {err}")
            continue
        atexit.register(server.close, notes)  # the child and its group go even if the benchmark fails
        if share is not None and server.group is None:  # the group went away between the probe and the load
            server.close(notes)
            notes.append(f"{name} skipped: its memory group could not be made")
            continue
        peers.append(LlamaCppBatch(name, server, eos_ids=eos, notes=notes))
    if peers:
        limited = "; 'memlimit' runs on its own copy of the file in a memory group, as bench.py's llama.cpp does"
        notes.append(f"llama.cpp batch: {gguf.name} ({kind}), {threads} thread(s), up to {most} sequences of "
                     f"{cells} cells each, f16 KV" + (limited if len(peers) > 1 else ""))
    return peers


def _gguf(target: Path, workdir: Path) -> tuple[Path, str]:
    from minions_local.models.builtin import SMOLLM2, builtin_name

    if builtin_name(target) == SMOLLM2:
        from minions_local.models.smollm2 import shipped_gguf

        return shipped_gguf(), "q4_1, shipped"
    from minions_local.backends.gguf_export import export_gguf

    return export_gguf(target, workdir / "target-f32.gguf", type="f32"), "f32, exported"


def _private_gguf(gguf: Path, workdir: Path) -> Path:
    """A copy of the GGUF that no other process maps, for the memory-limited child. A page
    another process has mapped (the in-RAM child's, a chat on the shipped file) survives
    every page-cache drop and group squeeze, so the limited child would find the weights
    in RAM. Copied once (beside an export in the run's folder; else in a cache folder)."""
    root = workdir if gguf.is_relative_to(workdir) else PRIVATE_GGUF_DIR
    dest = root / f"{gguf.stem}-memlimit.gguf"
    if dest.is_file() and dest.stat().st_size == gguf.stat().st_size:
        return dest
    root.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f"{dest.name}.{os.getpid()}.partial")
    shutil.copyfile(gguf, partial)
    partial.rename(dest)
    return dest


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _no_memory_group() -> str | None:
    """Why no memory group can be made here (None: one can)."""
    try:
        MemoryGroup.create(group_name("batch-probe")).remove()
    except (NoMemoryGroup, OSError) as err:
        return str(err)
    return None
