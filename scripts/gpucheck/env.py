"""The machine: GPU, driver, torch, free VRAM, and how fast pinned RAM reaches the GPU.

The copy peak is the yardstick of the curve's copy efficiency: a plain pinned host ->
device copy of a layer-sized buffer, with nothing else running. On the CPU (the
rehearsal) the same code times a RAM -> RAM copy, which is what the RAM tier does
there.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import time

import torch

from minions_local.offload.layout import aligned_empty

# What the engine's path imports beyond the GPU image (travel.py carries their wheels).
CARRIED = ("pydantic", "platformdirs")
# What the lent image lacks and no step here needs; listed so a result says so.
ABSENT_OK = ("textual", "gguf", "llama_cpp")


def copy_gbps(device: str, nbytes: int = 256 << 20, repeats: int = 8, rounds: int = 3,
              pageable: bool = False) -> dict:
    """GB/s of back-to-back host -> `device` copies of one `nbytes` buffer (pinned on
    CUDA; with `pageable`, also from ordinary memory, for the record): the median of
    `rounds`."""
    cuda = device.startswith("cuda")
    src = aligned_empty(nbytes, pin=cuda)
    src.fill_(1)  # touched: the first copy must not be paying the page faults
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def timed(source: torch.Tensor) -> float:
        speeds = []
        for _ in range(rounds):
            _sync(cuda)
            t0 = time.perf_counter()
            for _ in range(repeats):
                dst.copy_(source, non_blocking=cuda)
            _sync(cuda)
            speeds.append(nbytes * repeats / (time.perf_counter() - t0) / 1e9)
        return round(statistics.median(speeds), 2)

    timed(src)  # warm: the copy engine's first use, the allocator
    out = {"copy_bytes": nbytes, "pinned_gbps" if cuda else "ram_gbps": timed(src)}
    if cuda and pageable:
        out["pageable_gbps"] = timed(torch.ones(nbytes, dtype=torch.uint8))
    return out


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def environment(device: str, quick: bool = False) -> dict:
    """What this machine is, with its copy peaks (seconds; the rehearsal copies less)."""
    info: dict = {"python": platform.python_version(), "torch": torch.__version__,
                  "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count(), "host": platform.node()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError as err:  # named, not fatal: the tests step will say what it costs
        info["transformers"] = f"missing: {err}"
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                    vram_total_gb=round(total / 1e9, 1), vram_free_gb=round(free / 1e9, 1),
                    driver=_driver())
    info["missing_carried"] = [m for m in CARRIED if not _importable(m)]
    info["absent"] = [m for m in ABSENT_OK if not _importable(m)]
    try:
        with open("/proc/meminfo") as f:
            info["ram_gb"] = round(int(f.readline().split()[1]) / 1e6, 1)
    except OSError:
        pass
    info.update(copy_gbps(device, nbytes=(32 << 20) if quick else (256 << 20), pageable=True))
    return info


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a broken or blocked package is as good as absent
        return False


def _driver() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "unknown (no nvidia-smi)"
    proc = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=30)
    return proc.stdout.strip() or f"unknown ({proc.stderr.strip()[:200]})"
