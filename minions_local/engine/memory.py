"""Where the loaded weights actually are, for engines built without a memory plan.

The resident part is what the target's forward reads (`weight_bytes`: a compact
target counts its own fused copies, never the modules' released ones); a streamed
target adds what its layer store holds per tier. Minions with torch weights sit on
the compute device; GGUF minions (llama.cpp's own memory) and the n-gram minion hold
none that torch can count. How many requests fit beside them is planning/capacity.py.
"""

from __future__ import annotations

from typing import Sequence

from minions_local.core.protocols import Minion, Target


def measured_bytes_by_tier(target: Target, minions: Sequence[Minion]) -> dict[str, int]:
    tiers = {"device": target.weight_bytes()}
    stats = getattr(target, "stream_stats", None)
    for tier, n in (stats.bytes_by_tier if stats is not None else {}).items():
        tiers[tier] = tiers.get(tier, 0) + n
    for m in minions:
        if hasattr(m, "weight_bytes"):
            tiers["device"] += m.weight_bytes()
    return tiers


def describe_placement(target: Target, minions: Sequence[Minion]) -> str:
    streamed = getattr(target, "stream_stats", None) is not None
    rows = [("target", "streamed" if streamed else "resident")]
    rows += [(m.name, type(m).__name__) for m in minions]
    lines = [f"{name:<24} {kind}" for name, kind in rows]
    lines += [f"{tier:<24} {n / 2**20:,.1f} MiB" for tier, n in measured_bytes_by_tier(target, minions).items()]
    return "\n".join(lines)
