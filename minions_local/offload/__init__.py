"""Where the target's weights live and how they move: resident, RAM and disk tiers.

The engine's entry point is `load_streamed_causal_lm` (see `streamed.py`). Imports are
lazy so that light modules of this package do not pull in torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minions_local.offload.layer_store import StreamStats
    from minions_local.offload.streamed import load_streamed_causal_lm

__all__ = ["StreamStats", "load_streamed_causal_lm"]


def __getattr__(name: str) -> Any:
    if name == "StreamStats":
        from minions_local.offload.layer_store import StreamStats

        return StreamStats
    if name == "load_streamed_causal_lm":
        from minions_local.offload.streamed import load_streamed_causal_lm

        return load_streamed_causal_lm
    raise AttributeError(name)
