"""Where the loaded weights actually are, for engines built without a memory plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minions_local.engine import Engine


def measured_bytes_by_tier(engine: Engine) -> dict[str, int]:
    tiers: dict[str, int] = {}
    target = engine.decoder.target
    stats = getattr(target, "stream_stats", None)
    if stats is not None and hasattr(stats, "bytes_by_tier"):
        for tier, n in stats.bytes_by_tier().items():
            tiers[tier] = tiers.get(tier, 0) + n
    else:
        tiers["device"] = target.weight_bytes()  # a compact target counts its own copies
    for m in engine.minions:
        if hasattr(m, "weight_bytes"):  # model minions; GGUF and n-gram ones hold no torch weights
            tiers["device"] = tiers.get("device", 0) + m.weight_bytes()
    return tiers


def describe_placement(engine: Engine) -> str:
    rows = [("target", "resident" if getattr(engine.decoder.target, "stream_stats", None) is None else "streamed")]
    rows += [(m.name, type(m).__name__) for m in engine.minions]
    tiers = measured_bytes_by_tier(engine)
    lines = [f"{name:<24} {kind}" for name, kind in rows]
    lines += [f"{tier:<24} {n / 2**20:,.1f} MiB" for tier, n in tiers.items()]
    return "\n".join(lines)
