"""Reading an HF safetensors checkpoint one tensor at a time (never the whole model)."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from minions_local.core.errors import ModelLoadError
from minions_local.offload.config_match import unloaded_weights_error


class Checkpoint:
    """The tensors of a model folder's `*.safetensors` files, by name, read lazily."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise ModelLoadError(
                f"{self.folder} is not a model folder (no config.json). Point the target at an "
                "HF checkpoint folder saved with save_pretrained()."
            )
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(
                f"{self.folder} has no .safetensors files; streaming reads safetensors only. "
                "Re-save the model with save_pretrained(..., safe_serialization=True)."
            )
        self.files = files
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        for f in files:
            for name in self._open(f).keys():
                self._where[name] = f

    def _open(self, file: Path):
        handle = self._handles.get(file)
        if handle is None:
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise damaged_file_error(file, e) from e
            self._handles[file] = handle
        return handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._where[name]).get_slice(name).get_shape())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the file headers (no weights are read)."""
        return {name: self.shape(name) for name in self._where}

    def unused_by(self, model) -> list[str]:
        """Stored tensors that `model` (built from config.json) has no parameter or buffer
        for: loading would drop them. Old checkpoints' rotary tables are recomputed, not
        loaded, so they do not count (transformers skips them the same way)."""
        wanted = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        wanted |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
        skip = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
        skip.append(re.compile(r"rotary_emb\.inv_freq"))
        return [n for n in self._where if n not in wanted and not any(p.search(n) for p in skip)]

    def check_all_used(self, model) -> None:
        """Refuse a model that would leave stored tensors unused (config.json describes
        fewer layers than the files hold, say), naming config.json and the numbers.
        Tensors the model lacks fail later, when a layer asks for them."""
        unused = self.unused_by(model)
        if unused:
            raise unloaded_weights_error(self.folder, model.config, self.shapes(), unexpected=unused)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ModelLoadError(f"{self.folder} lacks tensor {name!r}; the checkpoint does not match its config.json.")
        return self._open(self._where[name]).get_tensor(name)

    def fingerprint(self) -> str:
        """Changes whenever a weight file or the config changes (size, mtime, config text)."""
        h = hashlib.sha1()
        for f in self.files:
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        h.update((self.folder / "config.json").read_bytes())
        return h.hexdigest()

    def drop_page_cache(self) -> None:
        """Packing reads every weight once; don't leave them crowding the page cache."""
        for f in self.files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def close(self) -> None:
        self._handles.clear()


def damaged_file_error(file: Path, err: BaseException) -> ModelLoadError:
    """A weights file safetensors cannot read, named (a folder can hold many shards)."""
    return ModelLoadError(
        f"{file} is damaged or incomplete: safetensors cannot read it ({err}); a download or copy that stopped "
        "early leaves a truncated file. Restore that file (re-download or re-export the model)."
    )


def folder_key(folder: Path) -> str:
    """A cache folder name for a model folder: readable and unique per absolute path."""
    digest = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:10]
    return f"{folder.resolve().name}-{digest}"

