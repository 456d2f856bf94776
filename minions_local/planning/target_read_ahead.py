"""A GGUF target's file read into the page cache from the moment its path is known, where
it will be held in RAM: the chat and the server start it before torch is imported, the
engine before it plans; `load_llama_target` then takes the reader as its own
(llama_stream.claim_read_ahead) instead of starting one after the plan. Where llama.cpp
computes it, its model is loaded from then on too (backends/llama_early.py).

A first chat on an 8B-shaped Q4_K_M held in RAM spends ~2.5 s importing torch and
planning before the load's own reader starts, while the disk sits idle, and the file's
read (4.35 GB at 0.8-0.9 GB/s on the 2-core EPYCs measured) is the longest part of the
load. Only a file that surely stays resident is read this early: one at most half the
memory usable now (machine_memory: MemAvailable or the cgroup's room), since held in RAM
its Q4_K matrices are copied too. A file the plan may stream is left to the load, which
reads its resident layers only.

Stdlib only (no torch, no numpy), so that calling it costs nothing before the imports.
"""

from __future__ import annotations

import os

from minions_local.backends.llama_early import build_minion_early, load_model_early
from minions_local.backends.llama_stream import read_files_ahead
from minions_local.models.gguf_file import shard_paths
from minions_local.planning.machine_memory import usable_memory
from minions_local.planning.memory_plan import gguf_on_llama_cpp

RESIDENT_SHARE = 0.5
"""Read early only a file at most this share of the memory usable now."""


def read_target_ahead(path: str | os.PathLike | None, *, on_llama_cpp: bool = False) -> bool:
    """Start reading the GGUF target at `path` (any shard of a split one) on a thread of its
    own when it will be held in RAM, and with `on_llama_cpp` loading its model on another;
    whether a reader runs for it now. Anything else (no path, not a .gguf, a missing file,
    too large) starts nothing and says nothing: the load names a bad file."""
    if path is None or not str(path).lower().endswith(".gguf"):
        return False
    try:
        paths = [p.resolve() for p in shard_paths(path)]
        sizes = [p.stat().st_size for p in paths]
    except OSError:
        return False
    memory = usable_memory()
    if memory is None or sum(sizes) > RESIDENT_SHARE * memory.usable:
        return False
    read_files_ahead(paths)
    if on_llama_cpp:
        load_model_early(paths[0])
    return True


def read_profile_target_ahead(profile, *, minions_known: bool = True) -> bool:
    """read_target_ahead for a loaded profile's target where this machine computes all of
    it: a CPU profile's, not one split over RPC servers (each reads its own layers), nor
    one whose tier lets it stream from disk (cpu-demo-gguf-disk streams a file that fits:
    read early, its streamed layers would come from RAM). Where its model loads early, so
    do the profile's GGUF minions on the CPU when `minions_known` (they are the ones the
    engine will load: named, or the profile's own for its own target, or fitted)."""
    if profile.target.rpc or profile.hardware.device != "cpu" or profile.target.tier == "disk":
        return False
    on_llama_cpp = gguf_on_llama_cpp(profile.target.gguf_kernel, profile.hardware.device)
    reading = read_target_ahead(profile.target.path, on_llama_cpp=on_llama_cpp)
    if reading and on_llama_cpp and minions_known:
        for minion in profile.minions:
            if minion.kind == "gguf" and minion.path and (minion.device or "cpu") == "cpu":
                try:
                    build_minion_early(shard_paths(minion.path)[0])
                except (OSError, ValueError):
                    pass  # the load names a missing file
    return reading


def read_named_profile_target_ahead(profile: str | os.PathLike, **overrides) -> bool:
    """read_profile_target_ahead for a profile by name or path with Engine.from_profile's
    overrides (target=, minions=, rpc=, rpc_split=). A profile that does not load is the
    engine's to name, so nothing is said here."""
    from minions_local.core.errors import MinionsError
    from minions_local.planning.fitting import with_rpc
    from minions_local.profile import load_profile

    try:
        loaded = load_profile(profile, target=overrides.get("target"), minions=overrides.get("minions"))
        return read_profile_target_ahead(with_rpc(loaded, overrides.get("rpc"), overrides.get("rpc_split")),
                                         minions_known=minions_known(overrides.get("target"),
                                                                     overrides.get("minions")))
    except (MinionsError, OSError, ValueError):
        return False


def minions_known(target, minions) -> bool:
    """Whether a profile loaded with these overrides lists the minions the engine will load:
    not where a command-line target replaces the profile's and no minion is named (the
    plan then finds minions for that target: planning/fitting.py)."""
    return minions is not None or target is None
