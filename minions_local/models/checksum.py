"""File checksums, the one way every model cache and manifest records them."""

from __future__ import annotations

import hashlib
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
