"""Built-in models: names a profile may use as `builtin:NAME`, and where they are cached.

A built-in model is made on this machine from weights installed from the package
index (see smollm2.py), so it lives in the user's cache, not in the package. This
module only names places (no torch, no conversion): the profile loader resolves
`builtin:NAME` with it, and the model loader asks smollm2.py to build what is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

from minions_local.core.errors import ProfileError

CACHE_ENV = "MINIONS_CACHE_DIR"
"""Overrides the user cache folder (tests point it at a temporary folder)."""

SMOLLM2 = "smollm2-135m-instruct"
BUILTIN_MODELS = (SMOLLM2,)


def cache_root() -> Path:
    """$MINIONS_CACHE_DIR, else the platform's user cache folder for minions-local."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("minions-local", appauthor=False))


def models_cache() -> Path:
    """Where built-in models are converted to (one folder or file per model)."""
    return cache_root() / "models"


def builtin_path(name: str) -> Path:
    """The Hugging Face folder a `builtin:NAME` reference stands for (built on first load)."""
    if name not in BUILTIN_MODELS:
        raise ProfileError(f"unknown built-in model 'builtin:{name}'; built-in models: "
                           f"{', '.join(f'builtin:{n}' for n in BUILTIN_MODELS)}")
    return models_cache() / name


def builtin_name(path: str | os.PathLike) -> str | None:
    """The built-in model a resolved path belongs to, or None for the user's own models."""
    path = Path(path).expanduser().resolve()
    for name in BUILTIN_MODELS:
        if path == builtin_path(name).resolve():
            return name
    return None
