"""minions-local: lossless multi-minion token-tree speculative decoding for streamed targets.

    from minions_local import Engine, load_profile
    engine = Engine.from_profile("cpu-demo")
    print(engine.generate("def fibonacci(n):", max_new_tokens=64).text)

Attributes load lazily, so `import minions_local` (and the TUI) stays free of torch
until an engine is actually built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "Engine": ("minions_local.engine.engine", "Engine"),
    "load_profile": ("minions_local.profile.loader", "load_profile"),
    "Generation": ("minions_local.core.events", "Generation"),
    "StepRecord": ("minions_local.core.events", "StepRecord"),
    "MinionsError": ("minions_local.core.errors", "MinionsError"),
}

if TYPE_CHECKING:
    from minions_local.engine.engine import Engine
    from minions_local.core.errors import MinionsError
    from minions_local.core.events import Generation, StepRecord
    from minions_local.profile.loader import load_profile


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'minions_local' has no attribute {name!r}") from None
    import importlib

    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


__all__ = list(_LAZY)
