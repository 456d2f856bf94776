"""From a profile to `Engine.from_pretrained` arguments (used by `Engine.from_profile`).

The profile says what the machine and models are; the memory plan says where each
target layer lives; the cost model (as a budget policy) says how large each tree is.
This module only translates, so the engine never reads TOML and the profile package
never imports torch.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from minions_local.backends.llama_early import drop_early_models
from minions_local.core.tiers import streams
from minions_local.planning.fitting import load_fitted
from minions_local.planning.memory_plan import MemoryPlan
from minions_local.planning.target_read_ahead import read_profile_target_ahead
from minions_local.profile import Profile


@contextlib.contextmanager
def untaken_models_freed() -> Iterator[None]:
    """Around a load from a profile: a target's model that llama.cpp loaded early
    (engine_kwargs_from_profile starts it: backends/llama_early.py) and the load did not
    take (it streamed the target after all, or it failed, the plan included) is freed at
    the end, not held for the process's life."""
    try:
        yield
    finally:
        drop_early_models()


def engine_kwargs_from_profile(
    name_or_path: str | os.PathLike,
    *,
    target: str | None = None,
    minions: Iterable[str] | None = None,
    tier: str | None = None,
    rpc: Iterable[str] | None = None,
    rpc_split: Iterable[float] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Keyword arguments for Engine.from_pretrained; `options` (its own keywords) win.

    target / minions / tier: the same overrides as load_profile (the CLI's --target,
    --minion); a GGUF target on a CPU profile is fitted to this machine (planning/fitting.py).
    rpc / rpc_split: the target's layers over RPC servers (--rpc, --rpc-split; [target] rpc).
    Raises ProfileError or MemoryPlanError with a message for the user.
    """
    fitted = load_fitted(name_or_path, target=target, minions=minions, tier=tier, rpc=rpc, rpc_split=rpc_split)
    profile = fitted.profile
    check_format(profile)
    read_profile_target_ahead(profile)  # while it plans (the CLIs start it before torch is imported)
    plan = fitted.plan()
    math = target_math(profile, plan, options.get("dtype"), options.get("compute_dtype"))
    if math != profile.target.dtype:  # its KV cache, embeddings and head are held wider
        plan = fitted.plan(math_dtype=math)
    kwargs = {
        "target": profile.target.path,
        "minions": [minion_spec(m, profile.hardware.device) for m in profile.minions],
        "device": profile.hardware.device,
        "dtype": profile.target.dtype,
        "compute_dtype": profile.target.compute_dtype,
        "target_tier": "device" if profile.target.rpc else engine_tier(plan),
        "budget": budget_policy(profile, plan),
        "max_depth": profile.speculation.max_depth,
        "top_k": profile.speculation.top_k,
        "grow_ahead": profile.speculation.grow_ahead,
        "stream_options": stream_options(profile, plan),
        "profile_name": profile.name,
        "memory_plan": plan,
    }
    kwargs.update(options)
    return kwargs


def check_format(profile: Profile) -> None:
    """The loader tells a GGUF target by its .gguf suffix: a profile's format must agree."""
    from minions_local.core.errors import ProfileError

    path, fmt = str(profile.target.path), profile.target.format
    if (fmt == "gguf") != path.lower().endswith(".gguf"):
        raise ProfileError(f"{profile.name}: target.format = '{fmt}' but its path {path} "
                           f"{'is not' if fmt == 'gguf' else 'is'} a .gguf file; set format = "
                           f"'{'hf' if fmt == 'gguf' else 'gguf'}' or point path at the model.")


def minion_spec(minion, device: str) -> Any:
    """What the loader needs of a profile's minion: its path and placement options."""
    from minions_local.engine.loading import MinionSpec

    if minion.kind == "ngram":
        return "ngram"
    kind = minion.kind if minion.kind in ("substitute", "self_draft", "eagle") else "auto"
    return MinionSpec(path=str(minion.path or ""), name=minion.name, quantization=minion.quantization,
                      device=minion.device or device, dtype=minion.dtype, kind=kind, layers=minion.layers)


def target_math(profile: Profile, plan: MemoryPlan, dtype: Any = None, compute: Any = None) -> str:
    """The dtype name the target will compute in (engine/loading.resolve_compute_dtype)."""
    from minions_local.engine.loading import resolve_compute_dtype
    from minions_local.offload.dtypes import compute_dtype, dtype_name

    weights = compute_dtype(dtype or profile.target.dtype)
    device = profile.hardware.device
    math = resolve_compute_dtype(weights, compute or profile.target.compute_dtype, device,
                                 streams(engine_tier(plan), device))
    return dtype_name(math)


def engine_tier(plan: MemoryPlan) -> str:
    """The lowest tier any layer uses: what the loader must be able to stream from."""
    for tier in ("disk", "ram"):
        if tier in plan.layer_tiers:
            return tier
    return "device"


def stream_options(profile: Profile, plan: MemoryPlan) -> dict[str, Any]:
    tgt = profile.target
    # A GGUF target's kernel decides where it computes (llama.cpp, or torch's paths).
    options: dict[str, Any] = {"kernel": tgt.gguf_kernel, "context_tokens": tgt.context_tokens} \
        if tgt.format == "gguf" else {}
    if tgt.rpc:  # pooled over machines: nothing streams (backends/llama_remote.py)
        return {**options, "rpc": {"servers": list(tgt.rpc), "shares": tgt.rpc_split, "timeout": tgt.rpc_timeout_s}}
    if engine_tier(plan) == "device":
        return options
    # The streaming runtime stores every decoder layer at one quantization; the
    # streamed one is what sets the bytes per pass.
    options.update({
        "layer_tiers": list(plan.layer_tiers),
        "quant": "gguf" if tgt.format == "gguf" else tgt.streamed_quantization,
        "buffers": plan.buffers.count or tgt.layer_buffers,
        "cache_dir": str(Path(profile.hardware.disk_path).expanduser()),
    })
    return options


def budget_policy(profile: Profile, plan: MemoryPlan) -> Any:
    """The cost-model policy when the profile is adaptive, else its fixed budget."""
    spec = profile.speculation
    if not spec.adaptive:
        return spec.budget
    from minions_local.planning.cost_prior import budget_from_profile

    return budget_from_profile(profile, plan)
