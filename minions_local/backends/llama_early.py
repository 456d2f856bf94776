"""A GGUF target's model loaded by llama.cpp from the moment its path is known, where it
will be held in RAM: planning/target_read_ahead.py starts it beside the file's reader,
before torch is imported, and LlamaTarget takes the loaded model (claim_early_model)
instead of loading it after the imports, the plan and the cut's build.

Held in RAM, llama.cpp's load is the longest part of a first chat: it maps the file, waits
on its reads and copies the Q4_K matrices into their interleaved form (fresh memory, which
this VM's host backs page by page). Started after the imports, it began 6-7 s into the
load of an 8B-shaped Q4_K_M on a 2-core EPYC (torch's libraries read from a cold disk
beside the file's reader) and the target was ready at 18 s.

The early load is the same call LlamaTarget makes for a model held in RAM: llama.cpp's
defaults (no GPU layers, the file mapped and read ahead) with the interleaved copy
(load_switches). It runs on a thread of its own: ctypes lets go of the GIL for the call,
so the imports go on meanwhile. Its log lines are its thread's own (log_lines): a failed
early load says nothing, and LlamaTarget loads the file again so that a bad file is named
in the load's own words. A model nobody claims (the plan streamed it after all, or the
engine's load failed) is freed when the engine's load ends (drop_early_models).

The GGUF minions the plan names are made early too (build_minion_early, claimed by
GGUFMinion.from_path), once the target's load has chosen its weights' buffers and let go
of its switches (llama_context.load_model_file): what is left of the target's load is
reading and copying, and the minion's is no longer after it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable


class _EarlyLoad:
    """One file's load on its thread (`build` makes the thing, `free` frees it); `made` is
    set (or left None) once `done` is."""

    def __init__(self, path: Path, build: Callable[[Path], Any], free: Callable[[Any], None], name: str) -> None:
        self.path, self._build, self._free = path, build, free
        self.made: Any = None
        self.done = threading.Event()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        from minions_local.backends.llama_context import drop_held_errors, log_lines
        from minions_local.models.gguf_file import read_model

        try:
            read_model(self.path)  # a truncated or corrupt file goes to the load, which names it
            with log_lines(hold_errors=True):
                self.made = self._build(self.path)
                if not self.made:
                    drop_held_errors()  # the load proper says them
        except Exception:  # nothing is loaded early; the load proper reports the problem
            self.made = None
        finally:
            self.done.set()

    def free(self) -> None:
        self.done.wait()
        if self.made:
            self._free(self.made)
            self.made = None


def _target_model(path: Path) -> Any:
    """llama.cpp's model as a target held in RAM loads it (LlamaTarget)."""
    from minions_local.backends.llama_context import import_llama_cpp, load_model_file

    lib = import_llama_cpp()
    params = lib.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = True  # the interleaved Q4_K copy, as LlamaTarget held in RAM
    return load_model_file(lib, path, params, interleave=True)


def _free_target_model(model: Any) -> None:
    from minions_local.backends.llama_context import import_llama_cpp

    import_llama_cpp().llama_model_free(model)


def _minion(path: Path) -> Any:
    """A GGUF minion on the CPU with GGUFMinion's defaults, as the engine's load makes it."""
    from minions_local.backends.gguf import GGUFMinion

    return GGUFMinion(path)


_loads: dict[tuple[str, str], _EarlyLoad] = {}
_lock = threading.Lock()


def _start(kind: str, path: str | Path, build: Callable[[Path], Any], free: Callable[[Any], None]) -> None:
    key = (kind, str(Path(path).resolve()))
    with _lock:
        if key not in _loads:
            _loads[key] = _EarlyLoad(Path(key[1]), build, free, f"{kind}-early-load")


def _claim(kind: str, path: str | Path) -> _EarlyLoad | None:
    with _lock:
        load = _loads.pop((kind, str(Path(path).resolve())), None)
    if load is not None:
        load.done.wait()
    return load


def load_model_early(path: str | Path) -> None:
    """Start loading the GGUF model at `path` (its first shard) as a target held in RAM
    loads, on a thread of its own; once a file, however often asked."""
    _start("target", path, _target_model, _free_target_model)


def claim_early_model(path: str | Path, *, n_gpu_layers: int, interleave: bool, prefetch: bool) -> Any:
    """The model load_model_early loaded from `path`, once its load is done, now the
    caller's to free; None where none was started or it failed. One loaded otherwise than
    these settings ask is freed, and None returned."""
    load = _claim("target", path)
    if load is None:
        return None
    if n_gpu_layers or not interleave or not prefetch:
        load.free()
        return None
    return load.made


def build_minion_early(path: str | Path) -> None:
    """Start making the GGUF minion at `path` (its first shard) on the CPU, on a thread of
    its own (its llama.cpp model and its first context); once a file, however often asked.

    Why: made after the target, the SmolLM2 Q4_1 minion took 0.3-0.8 s of a first chat's
    load beside an 8B held in RAM (2-core EPYC), all on the load's critical path; made
    while the target's model loads, it is ready when the target is."""
    _start("minion", path, _minion, lambda minion: minion.close())


def claim_early_minion(path: str | Path, options: dict[str, Any]) -> Any:
    """The minion build_minion_early made from `path`, now the caller's; None where none was
    started, it failed, or `options` (GGUFMinion's keywords) ask for another (it is closed)."""
    load = _claim("minion", path)
    if load is None:
        return None
    if any(v != _MINION_DEFAULTS.get(k, object()) for k, v in options.items()):
        load.free()
        return None
    return load.made


_MINION_DEFAULTS = {"n_gpu_layers": 0}
"""The GGUFMinion keywords the engine's load may pass that an early minion was made with."""


def drop_early_models(path: str | Path | None = None) -> None:
    """Free what load_model_early loaded from `path` and nobody claimed, or everything
    loaded or made early that nobody claimed (minions included)."""
    with _lock:
        keys = [("target", str(Path(path).resolve()))] if path is not None else list(_loads)
        loads = [_loads.pop(k) for k in keys if k in _loads]
    for load in loads:
        load.free()
