"""The headline: a 70B-shaped target streamed from pinned RAM into one GPU.

Pass time against tree size (1-512 tokens verified in one pass) with every layer
streamed, then against how many layers stay resident in VRAM, for an int4 and a bf16
layer stack (benchmarks/synthetic.py: random weights, real shapes and bytes). Beside
each, what the rtx4090-70b profile's cost prior projects for the same trees and
resident counts, as written and with this machine's measured copy peak in place of
the 4090's PCIe 4.0 link. Copy efficiency: bytes streamed over back-to-back 1-token
passes against a plain pinned copy of one layer.

Every point is saved as soon as it is measured, and a point whose passes would
outlast the deadline is not started: the step keeps what it measured when time runs
short, and says what it left out.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from benchmarks.streaming import Runner, streamed_run
from benchmarks.synthetic import SyntheticStack

from gpucheck.env import copy_gbps
from minions_local.backends.hf_target import HFTarget, exact_target

QUANTS = {"int4": "int4", "bf16": "none"}  # the curve's name -> the layer stack's storage
PROFILE = "rtx4090-70b"


@dataclass(frozen=True)
class CurvePlan:
    shape: str
    layers: int
    sizes: tuple[int, ...]
    """Tree sizes with every layer streamed, most telling first (time may run out)."""
    residents: tuple[int, ...]
    """Resident layer counts swept, in the order measured."""
    resident_sizes: tuple[int, ...]
    repeats: int
    """Passes a point takes; their median is its time."""
    buffers: int = 2
    """Layer buffers: the rtx4090-70b profile's layer_buffers."""
    int4_share: float = 0.3
    """Of the step's time, what the int4 stack may use: its passes move 4x fewer bytes
    (on an H100 at ~50 GB/s its whole plan takes ~60 s, the bf16 one ~170)."""


def curve_plan(device: str, quick: bool) -> CurvePlan:
    if device.startswith("cuda"):
        return CurvePlan("llama-70b", 80, (1, 512, 64, 8, 256, 16, 128, 2, 32, 4), (40, 80, 20, 60),
                         (1, 512, 64), repeats=3)
    # The rehearsal: the same code on the demo shape, small enough for CI's two cores.
    if quick:
        return CurvePlan("demo", 6, (1, 64, 8), (3, 6), (1, 64), repeats=1)
    return CurvePlan("demo", 6, (1, 512, 64, 8, 256, 16, 128, 2, 32, 4), (3, 6, 1, 4), (1, 512, 64), repeats=3)


def measure(plan: CurvePlan, quant: str, device: str, deadline: float, save: Callable[[dict], None]) -> dict:
    """One stack's curve (`quant`: 'int4' or 'bf16'); `save(result)` after every point."""
    stack = SyntheticStack(plan.shape, layers=plan.layers, quant=QUANTS[quant], dtype=torch.bfloat16,
                           device=device)
    out: dict = {"quant": quant, "shape": plan.shape, "layers": plan.layers, "layer_bytes": stack.layer_bytes,
                 "bytes_per_pass": stack.layer_bytes * plan.layers, "buffers": plan.buffers, "pass_ms": {},
                 "left_out": []}
    # The yardstick copies what one streamed layer moves, ~2 GiB a round on a GPU (the
    # rehearsal's CPU copies 128 MiB: its figure only shows the plumbing works).
    per_round = (2 << 30) if device.startswith("cuda") else (128 << 20)
    peak = copy_gbps(device, nbytes=stack.layer_bytes, repeats=max(2, per_round // stack.layer_bytes), rounds=3)
    out["copy_peak_gbps"] = peak.get("pinned_gbps", peak.get("ram_gbps"))
    slowest = 0.0
    for resident in (0, *plan.residents):
        sizes = plan.sizes if resident == 0 else plan.resident_sizes
        # A new model prefills a 64-token prefix (one pass) before its first point.
        if slowest and time.monotonic() + slowest * (1 + plan.repeats) > deadline:
            out["left_out"].append(f"{resident} resident layers: no time left")
            continue
        model, stats = stack.model(resident, buffers=plan.buffers)
        runner = Runner(f"resident-{resident}", _wrap(model, stats, device), stats, device)
        points = out["pass_ms"].setdefault(str(resident), {})
        if resident == 0:
            t0 = time.monotonic()
            runner.pass_(1)  # the first pass fills the pipeline and warms the kernels
            slowest = time.monotonic() - t0
            moved, seconds, _ = streamed_run(runner, 3)
            out["copy_achieved_gbps"] = round(moved / seconds / 1e9, 2)
            out["copy_efficiency"] = round(out["copy_achieved_gbps"] / out["copy_peak_gbps"], 3)
            slowest = max(slowest, seconds / 3)
            save(out)
        for size in sizes:
            if time.monotonic() + slowest * plan.repeats > deadline:
                out["left_out"].append(f"{resident} resident, tree {size}: no time left")
                continue
            times = [runner.pass_(size) for _ in range(plan.repeats)]
            slowest = max(slowest, *times) if resident == 0 else slowest
            points[str(size)] = round(statistics.median(times) * 1e3, 2)
            save(out)
        del runner, model, stats
        _release(device)
    del stack
    _release(device)
    return out


def _wrap(model, stats, device: str) -> HFTarget:
    """The target as the engine wraps it on CUDA: transformers' forward (exact_target
    picks the compact forward on a CPU only). The rehearsal takes the same wrapper, so
    it runs the code a GPU will."""
    streamed = (lambda: stats.bytes_streamed)
    if device.startswith("cuda"):
        return exact_target(model, bytes_streamed=streamed)
    return HFTarget(model, bytes_streamed=streamed)


def _release(device: str) -> None:
    gc.collect()  # the layer store's threads and buffers go with their model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def projection(quant: str, sizes: list[int], residents: list[int], copy_peak_gbps: float | None) -> dict:
    """What the rtx4090-70b profile's prior says a pass takes: by tree size with every
    layer streamed, and by resident layers (1-token and largest trees), for the profile
    as written and, given a copy peak, with it as the host -> device speed."""
    from minions_local.planning.memory_plan import plan_memory
    from minions_local.profile import load_profile
    from minions_local.planning.cost_prior import verify_prior

    from minions_local.core.errors import MemoryPlanError

    profile = load_profile(PROFILE)
    storage = {"int4": "int4", "bf16": "none"}[quant]
    target = profile.target.model_copy(update={"streamed_quantization": storage, "resident_quantization": storage})
    # 80 bf16 layers are 137 GB: the 4090 box's 64 GB of RAM could not hold them, but
    # the prior's speeds are what is compared, so its RAM grows to fit them.
    hardware = profile.hardware.model_copy(update={"host_ram_gb": max(profile.hardware.host_ram_gb, 256.0)}) \
        if quant == "bf16" else profile.hardware
    variants = {PROFILE: profile.model_copy(update={"target": target, "hardware": hardware})}
    if copy_peak_gbps:
        here = hardware.model_copy(update={"host_to_device_gbps": copy_peak_gbps})
        variants[f"{PROFILE} at this copy peak"] = profile.model_copy(update={"target": target, "hardware": here})
    out = {}
    for name, base in variants.items():
        def verify_at(resident: int):
            p = base.model_copy(update={"target": base.target.model_copy(update={"resident_layers": resident})})
            plan = plan_memory(p)
            return verify_prior(p, plan, context=1024)[0], plan.resident_layers

        try:
            streamed, _ = verify_at(0)
        except MemoryPlanError as err:
            out[name] = {"error": str(err)}
            continue
        by_resident = {}
        for r in residents:
            verify, placed = verify_at(r)
            by_resident[str(r)] = {"placed": placed, "ms": {str(s): round(verify(s - 1) * 1e3, 2)
                                                            for s in (min(sizes), max(sizes))}}
        out[name] = {"pass_ms": {str(s): round(streamed(s - 1) * 1e3, 2) for s in sorted(sizes)},
                     "by_resident": by_resident}
    return out


def run_curve(device: str, quick: bool, deadline: float, save: Callable[[dict], None]) -> dict:
    """Both stacks (int4 first: the rtx4090-70b profile's storage), then the projections."""
    plan = curve_plan(device, quick)
    result: dict = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
                    "plan": {"shape": plan.shape, "layers": plan.layers, "repeats": plan.repeats,
                             "buffers": plan.buffers}}
    for quant in QUANTS:
        now = time.monotonic()
        until = now + (deadline - now) * plan.int4_share if quant == "int4" else deadline

        def keep(partial: dict, quant: str = quant) -> None:
            result[quant] = partial
            save(result)

        try:
            keep(measure(plan, quant, device, until, keep))
        except (RuntimeError, MemoryError) as err:  # CUDA errors and OOM are RuntimeErrors: keep the other stack
            result.setdefault(quant, {})["error"] = f"{type(err).__name__}: {err}"[:2000]
            save(result)
            _release(device)
    for quant in QUANTS:
        res = result.get(quant, {})
        if res.get("pass_ms"):
            residents = sorted({0, *(int(r) for r in res["pass_ms"])})
            res["projection"] = projection(quant, list(plan.sizes), residents, res.get("copy_peak_gbps"))
    save(result)
    return result
