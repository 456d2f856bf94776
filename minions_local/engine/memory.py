"""Where the loaded weights actually are, for engines built without a memory plan.

The resident part is what the target's forward reads (`weight_bytes`: a compact
target counts its own fused copies, never the modules' released ones); a streamed
target adds what its layer store holds per tier. Minions with torch weights sit on
the compute device; GGUF minions (llama.cpp's own memory) and the n-gram minion hold
none that torch can count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minions_local.engine.engine import Engine


def measured_bytes_by_tier(engine: Engine) -> dict[str, int]:
    target = engine.decoder.target
    tiers = {"device": target.weight_bytes()}
    stats = getattr(target, "stream_stats", None)
    for tier, n in (stats.bytes_by_tier if stats is not None else {}).items():
        tiers[tier] = tiers.get(tier, 0) + n
    for m in engine.minions:
        if hasattr(m, "weight_bytes"):
            tiers["device"] += m.weight_bytes()
    return tiers


def describe_placement(engine: Engine) -> str:
    streamed = getattr(engine.decoder.target, "stream_stats", None) is not None
    rows = [("target", "streamed" if streamed else "resident")]
    rows += [(m.name, type(m).__name__) for m in engine.minions]
    lines = [f"{name:<24} {kind}" for name, kind in rows]
    lines += [f"{tier:<24} {n / 2**20:,.1f} MiB" for tier, n in measured_bytes_by_tier(engine).items()]
    return "\n".join(lines)


SLOT_SHARE = 0.5
"""Of the memory free at load, the share a batch's per-request caches may plan for:
the rest is headroom (activations, a long prompt's chunk, the page cache a streamed
target reads around)."""


def slot_bytes(engine: Engine) -> int:
    """What one more concurrent request can come to hold: the target's KV cache over the
    whole context window, plus each minion's per-request state (its own cache)."""
    target = engine.decoder.target
    per_token = target.kv_bytes_per_token() if hasattr(target, "kv_bytes_per_token") else 0
    total = per_token * engine.context_length
    for m in engine.minions:
        if hasattr(m, "slot_bytes"):
            total += m.slot_bytes()
        elif hasattr(getattr(m, "runner", None), "kv_bytes_per_token"):
            total += m.runner.kv_bytes_per_token() * engine.context_length
    return total


def slots_that_fit(engine: Engine, free: int | None = None) -> int:
    """Concurrent requests whose caches fit in SLOT_SHARE of `free` bytes (default: the
    memory free now on the target's device)."""
    free = free_bytes(engine.decoder.target.device) if free is None else free
    need = slot_bytes(engine)
    return max(1, int(free * SLOT_SHARE // need)) if need else 1


def free_bytes(device) -> int:
    """Memory free on `device` now (a CPU: MemAvailable)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    from minions_local.offload.streamed import available_ram

    return available_ram()
