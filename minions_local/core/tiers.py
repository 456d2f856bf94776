"""Where a target's weights live, fastest first: the compute device, host RAM, disk."""

from __future__ import annotations

from typing import Literal, get_args

Tier = Literal["device", "ram", "disk"]
TIERS: tuple[Tier, ...] = get_args(Tier)


def streams(tier: str, device: str) -> bool:
    """Whether a target whose lowest tier is `tier` streams layers into compute each
    pass. On a CPU the compute device IS host RAM: its 'ram' tier is a resident model."""
    return tier == "disk" or (tier == "ram" and device != "cpu")
