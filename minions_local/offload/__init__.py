"""Where the target's weights live and how they move: resident, RAM and disk tiers.

The engine's entry point is `load_streamed_causal_lm`; see `streamed.py`.
"""

from minions_local.offload.layer_store import StreamStats
from minions_local.offload.streamed import load_streamed_causal_lm

__all__ = ["StreamStats", "load_streamed_causal_lm"]
