"""The cost model's prior: coefficients predicted from a profile and its memory plan.

Physics only, before any step was measured: bytes over links, weights over device
memory bandwidth, flops over throughput, a launch overhead per layer. Measured layer
and minion timings in the profile (autotune's `measurements`) replace the guesses
where present. Online refinement (CostModel.refined) takes it from there.
"""

from __future__ import annotations

from minions_local.planning.memory_plan import MemoryPlan, plan_memory
from minions_local.profile.dims import ModelDims
from minions_local.profile.schema import Profile
from minions_local.speculation.cost import CostModel, GrowTime, VerifyTime
from minions_local.speculation.cost_policy import CostModelBudget

GB = 1e9
NGRAM_PASS_S = 0.0002  # a dictionary lookup per level
# A minion kept on the CPU of a GPU box: the profile measures only the GPU, so assume a
# desktop CPU (a few cores of AVX2, dual-channel DDR).
HOST_CPU_TFLOPS = 0.5
HOST_CPU_GBPS = 20.0


def stream_seconds(profile: Profile, plan: MemoryPlan) -> tuple[float, float]:
    """(seconds to bring the RAM-tier layers, seconds for the disk-tier layers)."""
    hw = profile.hardware
    by_tier = plan.streamed_bytes_by_tier
    ram_s = by_tier["ram"] / (hw.host_to_device_gbps * GB)
    disk_s = by_tier["disk"] / (hw.disk_read_gbps * GB)
    return ram_s, disk_s


def verify_prior(profile: Profile, plan: MemoryPlan, context: int) -> tuple[VerifyTime, dict]:
    hw, tgt, dims = profile.hardware, profile.target, plan.target_dims
    ram_s, disk_s = stream_seconds(profile, plan)
    if hw.device == "cuda":
        # Disk reads land in pinned RAM and then cross PCIe: two links in a pipeline,
        # the slower one sets the pace (and every streamed byte crosses PCIe).
        pcie_s = (plan.streamed_bytes_by_tier["ram"] + plan.streamed_bytes_by_tier["disk"]) / (
            hw.host_to_device_gbps * GB
        )
        stream = max(pcie_s, disk_s)
    else:
        stream = ram_s + disk_s  # reader threads and compute share the same memory bus
    math = plan.math_dtype or tgt.dtype  # bf16 weights widened to float32 math compute at its speed
    weights = plan.target_layer_bytes + dims.head_bytes(math)
    floor = weights / (hw.device_memory_gbps * GB)
    overhead = dims.layers * hw.layer_overhead_ms / 1e3
    slope = dims.flops_per_token(context) / (hw.tflops(math) * 1e12)
    measured = _measured_layer_slope(profile, dims)
    if measured is not None:
        floor_m, slope = measured
        floor = max(floor, floor_m)
    parts = {
        "stream_ram": ram_s,
        "stream_disk": disk_s,
        "stream": stream,
        "floor": floor,
        "overhead": overhead,
        "slope": slope,
    }
    return VerifyTime(flat=overhead + max(stream, floor), base=overhead, slope=slope), parts


def _measured_layer_slope(profile: Profile, dims: ModelDims) -> tuple[float, float] | None:
    """(pass floor, seconds per token) from autotune's per-layer timings, if any."""
    m = profile.measurements
    pts = [s for s in (m.target_layer if m else []) if s.model == "target"]
    if len(pts) < 2:
        return None
    pts.sort(key=lambda s: s.tokens)
    lo, hi = pts[0], pts[-1]
    per_token = max(hi.seconds - lo.seconds, 0.0) / max(hi.tokens - lo.tokens, 1)
    return lo.seconds * dims.layers, per_token * dims.layers


def grow_prior(profile: Profile, plan: MemoryPlan) -> tuple[GrowTime, ...]:
    hw = profile.hardware
    measured = {}
    if profile.measurements:
        for s in profile.measurements.grow:
            measured.setdefault(s.model, []).append((s.tokens, s.seconds))
    out = []
    for m in profile.minions:
        if m.kind == "ngram":
            out.append(GrowTime(m.name, NGRAM_PASS_S, 0.0))
            continue
        dims = plan.minion_dims[m.name]
        off_device = (m.device or hw.device) != hw.device
        mem_gbps = HOST_CPU_GBPS if off_device else hw.device_memory_gbps
        tflops = HOST_CPU_TFLOPS if off_device else hw.tflops(m.dtype)
        size = plan.minion_bytes[m.name]
        base = dims.layers * hw.layer_overhead_ms / 1e3 + size / (mem_gbps * GB)
        per_token = dims.flops_per_token(profile.target.context_tokens // 4) / (tflops * 1e12)
        g = GrowTime(m.name, base, per_token)
        if m.name in measured:
            g = g.fit(measured[m.name], weight=0.1)  # autotune's numbers beat the guess
        out.append(g)
    return tuple(out)


def cost_model_from_profile(profile: Profile, plan: MemoryPlan | None = None, *, context: int = 1024) -> CostModel:
    plan = plan or plan_memory(profile)
    verify, parts = verify_prior(profile, plan, context)
    return CostModel(verify=verify, grow=grow_prior(profile, plan), parts=parts)


def budget_from_profile(profile: Profile, plan: MemoryPlan | None = None, **kwargs) -> CostModelBudget:
    """The adaptive policy: prior from the profile (memory plan included), limits from
    profile.speculation."""
    spec = profile.speculation
    limits = dict(min_nodes=spec.min_budget, max_nodes=spec.max_budget, max_depth=spec.max_depth,
                  top_k=spec.top_k)
    return CostModelBudget(cost_model_from_profile(profile, plan), **{**limits, **kwargs})
