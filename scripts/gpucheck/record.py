"""The check's one result file, the code it ran, and docs/gpu/'s dated records.

The result is rewritten (atomically) after every step, so a call killed at its limit
still returns every finished step. It names the code by a fingerprint of what the GPU
path runs (offload/, backends/ and the decode step): the machine gets no .git, and a
record in docs/gpu/ with the current fingerprint means the check is not due again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "gpu"
FINGERPRINTED = ("minions_local/offload", "minions_local/backends", "minions_local/speculation/decode.py")


def code_fingerprint(repo: Path = REPO) -> str:
    """sha256 (first 16 hex digits) over the paths and bytes of the GPU path's sources."""
    digest = hashlib.sha256()
    for part in FINGERPRINTED:
        root = repo / part
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for f in files:
            digest.update(f.relative_to(repo).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


class Record:
    """gpu_check.json: the run's facts, then each step's result as it lands."""

    def __init__(self, path: Path, **facts) -> None:
        self.path = path
        self.data = {"check": "gpu_check", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "code": {"fingerprint": code_fingerprint(), "covers": list(FINGERPRINTED)}, **facts,
                     "steps": {}}
        self.write()

    def step(self, name: str, result: dict) -> None:
        self.data["steps"][name] = result
        self.write()

    def finish(self, seconds: float) -> None:
        self.data["seconds"] = round(seconds, 1)
        self.data["ok"] = all(s.get("rc") in (0, None) for s in self.data["steps"].values())
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)


def keep(result: Path, into: Path = DOCS) -> list[Path]:
    """Copy a GPU run's gpu_check.json (and its curve PNG beside it) into docs/gpu/ as
    DATE-GPU.json / .png; a rehearsal (not CUDA) is refused: it proves nothing there."""
    data = json.loads(result.read_text())
    if data.get("device") != "cuda":
        raise ValueError(f"{result} is a rehearsal on {data.get('device')!r}: docs/gpu/ keeps CUDA runs only")
    gpu = (data["steps"].get("env") or {}).get("result", {}).get("gpu", "gpu")
    stem = f"{data['started'][:10]}-{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}"
    into.mkdir(parents=True, exist_ok=True)
    base, n = stem, 1
    while (into / f"{stem}.json").exists():  # a second run that day: kept beside the first
        n += 1
        stem = f"{base}-{n}"
    kept = [into / f"{stem}.json"]
    shutil.copyfile(result, kept[0])
    png = result.parent / "curve-70b.png"
    if png.exists():
        kept.append(into / f"{stem}.png")
        shutil.copyfile(png, kept[-1])
    return kept


def due(docs: Path = DOCS) -> tuple[bool, str]:
    """Whether the check should run first on a lent GPU: no CUDA record in docs/gpu/
    for the current fingerprint."""
    current = code_fingerprint()
    for path in sorted(docs.glob("*.json")) if docs.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if data.get("device") == "cuda" and data.get("code", {}).get("fingerprint") == current:
            return False, f"not due: {path} holds a GPU run of the current code ({current})"
    return True, f"due: docs/gpu/ holds no GPU run of the current code of {', '.join(FINGERPRINTED)} ({current})"
