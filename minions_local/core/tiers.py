"""Where a target's weights live, fastest first: the compute device, host RAM, disk."""

from __future__ import annotations

from typing import Literal, get_args

Tier = Literal["device", "ram", "disk"]
TIERS: tuple[Tier, ...] = get_args(Tier)
