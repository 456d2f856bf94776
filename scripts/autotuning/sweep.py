"""The measurements autotune makes, by mode (--tiny, --quick, full), with progress:
the machine's disk, copies, memory and matmuls, then the template's models when they
are on disk and small enough to time here."""

from __future__ import annotations

import os
from pathlib import Path

from rich.progress import Progress

from autotuning import measure

MODES = {
    # disk file, copy size, matmul sizes, seconds per timing, widths, target tokens
    "tiny": dict(disk=16 << 20, copy=16 << 20, sizes=(128, 256), t=0.02, widths=(1, 4), tokens=(1, 8), models=False),
    "quick": dict(disk=256 << 20, copy=128 << 20, sizes=(256, 512, 1024), t=0.1, widths=(1, 4, 16),
                  tokens=(1, 16, 64), models=True),
    "full": dict(disk=1 << 30, copy=512 << 20, sizes=(256, 512, 1024, 2048), t=0.3, widths=(1, 2, 4, 8, 16, 32),
                 tokens=(1, 4, 16, 64, 256), models=True),
}
MODEL_RAM_SHARE = 0.25  # time models only if their weights fit in this share of RAM


def measure_all(template, mode: dict, args, progress: Progress) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtypes = ["bfloat16", "float32"] + (["float16"] if device == "cuda" else [])
    disk_path = Path(args.disk_path or template.hardware.disk_path).expanduser()
    r: dict = {"device": device, "disk_path": str(disk_path), "matmul": [], "grow": [], "target_layer": []}
    if device == "cuda":
        r["device_name"] = torch.cuda.get_device_name(0)
        r["device_total_gb"] = torch.cuda.get_device_properties(0).total_memory / 1e9
    else:
        r["device_name"] = f"CPU ({torch.get_num_threads()} threads)"

    task = progress.add_task("disk, copies, memory", total=4)
    r["disk"] = measure.disk_read_speeds(disk_path, mode["disk"])
    progress.advance(task)
    r["copy"] = measure.copy_speeds(mode["copy"], mode["t"])
    progress.advance(task)
    r["weight_read_gbps"] = measure.weight_read_gbps(device, template.target.dtype, mode["copy"], mode["t"])
    progress.advance(task)
    # A transformers forward of a tiny model; --tiny keeps the template's figure instead
    # (importing transformers alone takes seconds on a busy machine).
    r["layer_overhead_ms"] = (measure.layer_overhead_ms(device, mode["t"]) if mode["models"]
                              else template.hardware.layer_overhead_ms)
    progress.advance(task)

    # A GPU reaches its peak only on larger matrices than a CPU does.
    sizes = [n * 4 for n in mode["sizes"]] if device == "cuda" else mode["sizes"]
    task = progress.add_task("matmul by size and dtype", total=len(dtypes) * len(sizes))
    for dtype in dtypes:
        for n in sizes:
            r["matmul"].append({"dtype": dtype, "size": n, "tflops": measure.matmul_tflops(device, dtype, n, mode["t"])})
            progress.advance(task)

    if mode["models"] and not args.no_models:
        measure_models(template, mode, device, r, progress)
    return r


def measure_models(template, mode, device, r, progress) -> None:
    models = [(m.name, m.path, m.dtype, "grow", mode["widths"]) for m in template.minions if m.kind == "hf"]
    models.append(("target", template.target.path, template.target.dtype, "target_layer", mode["tokens"]))
    r["skipped"] = []
    for name, path, dtype, kind, sizes in models:
        reason = _why_not_timed(path)
        if reason:
            r["skipped"].append(f"{name}: {reason}")
            continue
        task = progress.add_task(f"{name} by {'width' if kind == 'grow' else 'tokens'}", total=len(sizes))
        model = measure.load_for_timing(path, dtype, device)
        per = model.config.num_hidden_layers if kind == "target_layer" else 1
        for n in sizes:
            seconds = measure.forward_seconds(model, n, prefix=128, min_seconds=mode["t"])
            r[kind].append({"model": name, "tokens": n, "seconds": seconds / per})
            progress.advance(task)
        del model


def _why_not_timed(path: str | None) -> str | None:
    if not path or not (Path(path) / "config.json").is_file():
        return "not on this machine"
    size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size == 0:
        return "no safetensors weights"
    if size > MODEL_RAM_SHARE * ram:
        return f"{size / 1e9:.0f} GB of weights: too large to time here (the layer store's bench does)"
    return None
