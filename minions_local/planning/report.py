"""`--plan`: what a profile would do on its machine, without loading any weights.

The memory plan, the cost model's step-time prior, and predicted tokens/s at the best
tree budget for a range of acceptance rates, next to what published systems report.
The predictions are estimates from the profile's speeds and a simple acceptance model;
the engine logs measured step times next to them, so the error is visible later.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

from minions_local.planning.cost_prior import cost_model_from_profile
from minions_local.planning.fitting import load_fitted
from minions_local.planning.memory_plan import gguf_on_llama_cpp
from minions_local.speculation.cost import CostModel

DEFAULT_ACCEPTANCE = (0.5, 0.6, 0.7, 0.8, 0.9)

# Published figures (design/ANCHORS.md): other systems, their own hardware and drafts.
ANCHORS = (
    ("UMbreLLa", "Llama-3.1-70B AWQ 4-bit + 8B draft, RTX 4090", "8.6 tok/s greedy, 7.2 sampled"),
    ("SpecExec", "50-70B 4-bit, RAM offload, consumer GPU", "4-6 tok/s"),
    ("Sequoia", "Llama-70B fp16 + 7B draft, RTX 4090", "0.57 s/token (1.8 tok/s)"),
)


def plan_report(
    name_or_path: str | os.PathLike,
    *,
    target: str | None = None,
    minions: Iterable[str] | None = None,
    tier: str | None = None,
    acceptance: Sequence[float] = DEFAULT_ACCEPTANCE,
    rpc: Sequence[str] | None = None,
    rpc_split: Sequence[float] | None = None,
) -> str:
    """The text `minions-chat --profile X --plan` prints. Raises ProfileError/MemoryPlanError.
    A GGUF `target` on a CPU profile is planned for this machine (planning/fitting.py); one
    split over RPC servers (`rpc`, or the profile's) gets its split and network (rpc_plan.py)."""
    fitted = load_fitted(name_or_path, target=target, minions=minions, tier=tier, rpc=rpc, rpc_split=rpc_split)
    profile, plan = fitted.profile, fitted.plan()
    model = cost_model_from_profile(profile, plan)
    spec = profile.speculation
    hw = profile.hardware
    d = plan.target_dims
    lines = [
        f"Profile {profile.name}: {profile.description}".rstrip(": ") if target is None else
        f"Profile {profile.name}, its target replaced by the one named on the command line",
        f"  target {profile.target.path}  ({d.params / 1e9:.1f}B params, {d.layers} layers, "
        f"{_storage(profile, d)})",
    ]
    for m in profile.minions:
        where = m.path or "(built in)"
        lines.append(f"  minion {m.name}: {m.kind}, {m.quantization}, {where}")
    lines += ["", plan.format(), "", _cost_lines(model, hw), ""]
    lines += _prediction_table(model, acceptance, spec)
    if profile.target.rpc:
        from minions_local.planning.rpc_plan import split_report

        lines += [""] + split_report(profile, model, acceptance, spec)
    lines += ["", "Published figures (other systems, their hardware and drafts):"]
    lines += [f"  {name:<9} {setting:<48} {figure}" for name, setting, figure in ANCHORS]
    lines.append(
        "Predictions are estimates from the profile's speeds (run scripts/autotune.py for "
        "yours) and a tree acceptance model; measured step times refine them online."
    )
    return "\n".join(lines)


def _storage(profile, dims) -> str:
    """How the target's weights are held and computed."""
    tgt = profile.target
    if tgt.format != "gguf":
        return f"{tgt.dtype}, resident {tgt.resident_quantization}, streamed {tgt.streamed_quantization}"
    from minions_local.profile.gguf_sizes import layer_bits_per_weight

    blocks = tgt.gguf_mix or f"{layer_bits_per_weight(tgt.path, None, dims):.1f} bits a layer weight"
    if gguf_on_llama_cpp(tgt.gguf_kernel, profile.hardware.device):
        return f"GGUF blocks ({blocks}), computed as they are by llama.cpp"
    return f"GGUF blocks ({blocks}), dequantized into {tgt.dtype}"


def _cost_lines(model: CostModel, hw) -> str:
    p = model.parts
    v = model.verify
    knee = max(0, int((v.flat - v.base) / v.slope) - 1) if v.slope else 0
    out = [
        "Cost model (prior, from the profile):",
        f"  verify: {v.flat * 1e3:.0f} ms per pass up to ~{knee} draft nodes, then "
        f"+{v.slope * 1e3:.2f} ms per node (stream {p.get('stream', 0) * 1e3:.0f} ms: RAM "
        f"{p.get('stream_ram', 0) * 1e3:.0f} ms at {hw.host_to_device_gbps:.3g} GB/s, disk "
        f"{p.get('stream_disk', 0) * 1e3:.0f} ms at {hw.disk_read_gbps:.3g} GB/s; weight-read "
        f"floor {p.get('floor', 0) * 1e3:.0f} ms; overhead {p.get('overhead', 0) * 1e3:.0f} ms)",
    ]
    for g in model.grow:
        out.append(
            f"  grow {g.name}: {g.base * 1e3:.1f} ms per pass + {g.per_token * 1e3:.3f} ms per node"
        )
    out.append(f"  target alone (autoregressive): {1 / v(0):.2f} tok/s")
    return "\n".join(out)


def _prediction_table(model: CostModel, acceptance: Sequence[float], spec) -> list[str]:
    base = 1 / model.t_verify(0)
    out = [
        "Predicted at the best budget (acceptance = chance the target takes the minions' "
        "top token at each depth; an estimate):",
        f"  {'accept':>6} {'nodes':>6} {'depth':>5} {'tok/pass':>8} {'t_grow':>8} "
        f"{'t_verify':>8} {'tok/s':>6} {'speedup':>7}",
    ]
    for a in acceptance:
        c = model.best_budget(
            a,
            min_nodes=spec.min_budget,
            max_nodes=spec.max_budget,
            max_depth=spec.max_depth,
            top_k=spec.top_k,
        )
        out.append(
            f"  {a:>6.2f} {c.nodes:>6} {c.depth:>5} {c.tokens_per_step:>8.1f} "
            f"{c.t_grow * 1e3:>6.0f}ms {c.t_verify * 1e3:>6.0f}ms {c.tokens_per_second:>6.2f} "
            f"{c.tokens_per_second / base:>6.1f}x"
        )
    return out
