"""The engine layer: the public `Engine` (generate / stream / chat over one decode
path), loading models, chat templates and incremental text, building an engine from a
profile, and accounting for where its weights are.

Everything above (the TUI, the server, the benchmarks) goes through `Engine`.
"""

from minions_local.engine.engine import Engine

__all__ = ["Engine"]
