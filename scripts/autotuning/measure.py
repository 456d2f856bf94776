"""Measuring this machine for a profile: disk, copies, memory, matmuls, model passes.

Each function measures one thing and returns plain numbers; `sweep` runs them with
progress, `output` writes the profile. torch and transformers are imported inside
the functions that need them: importing transformers alone takes seconds on a busy
machine. The O_DIRECT read is the benchmarks' raw-read yardstick (benchmarks/raw_reads.py).

Timings repeat until `min_seconds` have passed and keep the fastest repetition: on a
shared machine the fastest run is the one least disturbed by others.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

GB = 1e9
CHUNK = 16 << 20  # bytes per read call: enough for a disk's sequential speed


def _best_time(fn: Callable[[], object], min_seconds: float, min_reps: int = 2, sync=None) -> float:
    best, spent, reps = float("inf"), 0.0, 0
    while reps < min_reps or spent < min_seconds:
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


# -- disk ----------------------------------------------------------------------------


def disk_read_speeds(folder: Path, size: int) -> dict[str, float | None]:
    """Sequential read GB/s of a fresh `size`-byte file in `folder`.

    'direct': O_DIRECT (the page cache never sees the data; None where refused);
    'fadvise': buffered reads after posix_fadvise(DONTNEED) dropped the file's pages;
    'cached': a second buffered read, served from the page cache.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".autotune-{os.getpid()}.bin"
    size = max(CHUNK, size // CHUNK * CHUNK)
    try:
        _write_file(path, size)
        return {
            "direct": _read_direct(path, size),
            "fadvise": _read_buffered(path, size, drop=True),
            "cached": _read_buffered(path, size, drop=False),
        }
    finally:
        path.unlink(missing_ok=True)


def _write_file(path: Path, size: int) -> None:
    block = os.urandom(1 << 20) * (CHUNK >> 20)  # incompressible, in case the fs compresses
    with open(path, "wb") as f:
        for _ in range(size // CHUNK):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def _read_direct(path: Path, size: int) -> float | None:
    """O_DIRECT GB/s, one reader (the benchmarks' raw-read yardstick); None where refused."""
    from benchmarks.raw_reads import read_files_direct
    from minions_local.offload.layout import aligned_empty

    try:
        t0 = time.perf_counter()
        moved = read_files_direct([path], [aligned_empty(CHUNK)])
        return moved / (time.perf_counter() - t0) / GB if moved else None
    except OSError:
        return None


def _read_buffered(path: Path, size: int, drop: bool) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        if drop:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        else:
            while os.read(fd, CHUNK):  # warm the cache first
                pass
            os.lseek(fd, 0, os.SEEK_SET)
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        t0 = time.perf_counter()
        total = 0
        while (n := os.readv(fd, [view])) > 0:
            total += n
        return total / (time.perf_counter() - t0) / GB
    finally:
        if drop:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


# -- copies and memory -----------------------------------------------------------------


def copy_speeds(size: int, min_seconds: float) -> dict[str, float | None]:
    """GB/s of host->device copies: 'pinned' and 'pageable' on CUDA; 'memcpy' always."""
    import torch

    src = torch.empty(size, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    out: dict[str, float | None] = {
        "memcpy": size / _best_time(lambda: dst.copy_(src), min_seconds) / GB,
        "pinned": None,
        "pageable": None,
    }
    if torch.cuda.is_available():
        gpu = torch.empty(size, dtype=torch.uint8, device="cuda")
        sync = torch.cuda.synchronize
        pinned = src.pin_memory()
        out["pinned"] = size / _best_time(lambda: gpu.copy_(pinned, non_blocking=True), min_seconds, sync=sync) / GB
        out["pageable"] = size / _best_time(lambda: gpu.copy_(src), min_seconds, sync=sync) / GB
    return out


def weight_read_gbps(device: str, dtype_name: str, size: int, min_seconds: float) -> float:
    """GB/s at which a one-token matmul reads a weight matrix: the floor of a small pass."""
    import torch

    dtype = getattr(torch, dtype_name)
    cols = 4096
    rows = max(256, size // (cols * dtype.itemsize))
    w = torch.randn(rows, cols, dtype=dtype, device=device)
    x = torch.randn(1, cols, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else None
    t = _best_time(lambda: x @ w.T, min_seconds, min_reps=3, sync=sync)
    return w.numel() * dtype.itemsize / t / GB


def matmul_tflops(device: str, dtype_name: str, n: int, min_seconds: float) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else None
    a @ b  # first call may pick kernels
    t = _best_time(lambda: a @ b, min_seconds, sync=sync)
    return 2 * n**3 / t / 1e12


# -- model passes --------------------------------------------------------------------------


def layer_overhead_ms(device: str, min_seconds: float) -> float:
    """Per-layer cost of a transformers forward whose flops are negligible (a tiny model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layers = 8
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).to(device).eval()
    return forward_seconds(model, 1, prefix=16, min_seconds=min_seconds) / layers * 1e3


def forward_seconds(model, tokens: int, prefix: int, min_seconds: float) -> float:
    """Seconds for one forward of `tokens` new tokens on top of a `prefix`-token cache."""
    import torch
    from transformers import DynamicCache

    from minions_local.backends.hf import cache_kwargs

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, prefix + tokens), generator=gen).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :prefix], **cache_kwargs(model, cache), use_cache=True)
        positions = torch.arange(prefix, prefix + tokens, device=device)[None]

        def step():
            model(input_ids=ids[:, prefix:], **cache_kwargs(model, cache), position_ids=positions, use_cache=True)
            cache.crop(-tokens)  # transformers 5: a negative count of tokens to drop

        return _best_time(step, min_seconds, sync=sync)


def load_for_timing(path: str, dtype_name: str, device: str):
    """A transformers model from `path` for timing only (no tokenizer, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype_name))
    return model.to(device).eval()
