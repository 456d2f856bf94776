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
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any


class _EarlyLoad:
    """One file's load on its thread; `model` is set (or left None) once `done` is."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.model: Any = None
        self.done = threading.Event()
        threading.Thread(target=self._run, name="target-early-load", daemon=True).start()

    def _run(self) -> None:
        from minions_local.backends.llama_context import drop_held_errors, import_llama_cpp, load_model_file, log_lines
        from minions_local.models.gguf_file import read_model

        try:
            read_model(self.path)  # a truncated or corrupt file goes to the load, which names it
            lib = import_llama_cpp()
            params = lib.llama_model_default_params()
            params.n_gpu_layers = 0
            params.use_extra_bufts = True  # the interleaved Q4_K copy, as LlamaTarget held in RAM
            with log_lines(hold_errors=True):
                self.model = load_model_file(lib, self.path, params)
                if not self.model:
                    drop_held_errors()  # LlamaTarget's own load says them
        except Exception:  # nothing is loaded early; the load proper reports the problem
            self.model = None
        finally:
            self.done.set()

    def free(self) -> None:
        self.done.wait()
        if self.model:
            from minions_local.backends.llama_context import import_llama_cpp

            import_llama_cpp().llama_model_free(self.model)
            self.model = None


_loads: dict[str, _EarlyLoad] = {}
_lock = threading.Lock()


def load_model_early(path: str | Path) -> None:
    """Start loading the GGUF model at `path` (its first shard) as a target held in RAM
    loads, on a thread of its own; once a file, however often asked."""
    key = str(Path(path).resolve())
    with _lock:
        if key not in _loads:
            _loads[key] = _EarlyLoad(Path(key))


def claim_early_model(path: str | Path, *, n_gpu_layers: int, interleave: bool, prefetch: bool) -> Any:
    """The model load_model_early loaded from `path`, once its load is done, now the
    caller's to free; None where none was started or it failed. One loaded otherwise than
    these settings ask is freed, and None returned."""
    with _lock:
        load = _loads.pop(str(Path(path).resolve()), None)
    if load is None:
        return None
    load.done.wait()
    if n_gpu_layers or not interleave or not prefetch:
        load.free()
        return None
    return load.model


def drop_early_models(path: str | Path | None = None) -> None:
    """Free what load_model_early loaded and nobody claimed: `path`'s, or every one."""
    with _lock:
        keys = [str(Path(path).resolve())] if path is not None else list(_loads)
        loads = [_loads.pop(k) for k in keys if k in _loads]
    for load in loads:
        load.free()
