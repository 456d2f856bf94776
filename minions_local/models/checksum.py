"""File checksums, the one way every model cache and manifest records them."""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path


def sha256_of(path: str | os.PathLike[str]) -> str:
    """The hex SHA-256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_cached(path: str | os.PathLike[str]) -> str:
    """sha256_of, computed once per process while the file's size and time stand
    (0.3 s for SmolLM2's 270 MB of weights, paid on the first load of a session)."""
    stat = os.stat(path)
    return _sha256_keyed(str(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=64)
def _sha256_keyed(path: str, size: int, mtime_ns: int) -> str:
    return sha256_of(path)


MANIFEST = "manifest.json"


def write_manifest(folder: Path, **fields) -> None:
    """Record every file of `folder` (size and sha256) with `fields` in its manifest."""
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_of(p)}
             for p in sorted(folder.iterdir()) if p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({**fields, "files": files}, indent=2) + "\n")


def manifest_problem(folder: Path, **expected) -> str | None:
    """Why `folder` is not an intact cache ('not built yet', a missing or damaged file,
    made from other sources: a manifest field differing from `expected`), or None
    when every file matches its manifest."""
    if not folder.is_dir():
        return "not built yet"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    if any(manifest.get(key) != value for key, value in expected.items()):
        return "it was made by another version of minions-local or from another file"
    for name, meta in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != meta["size"]:
            return f"{name} has the wrong size"
        if sha256_cached(path) != meta["sha256"]:
            return f"{name} fails its checksum"
    return None
