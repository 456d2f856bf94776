"""Finding a minion for a target named on the command line: a small model on the target's
vocabulary, resident beside it, costs a fraction of a target pass to draft with.

Where one is looked for: the profile's own minions with a path, the models next to the
target (.gguf files, and Hugging Face folders with a config.json), and the shipped
SmolLM2-135M-Instruct GGUF. Only one much smaller than the target is taken (a tenth of its
bytes: a 135M model beside an 8B one is 1/40), and only on the same vocabulary (token
lists from the files: models/vocabulary.py). Each model looked at is kept with why it
was taken or passed over, for --plan and the chat to say.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from minions_local.core.errors import ModelLoadError

SMALLER_BY = 10
"""A minion takes at most 1/SMALLER_BY of the target's bytes."""


@dataclass(frozen=True)
class Found:
    path: Path
    size: int
    kind: str
    """'gguf' or 'hf'."""
    where: str
    """'next to the target', 'from the profile', 'shipped with minions-local'."""


@dataclass
class MinionSearch:
    chosen: list[Found] = field(default_factory=list)
    passed_over: list[str] = field(default_factory=list)
    """'name (why not)' for each model looked at and not taken."""


def find_minions(target: Path, target_size: int, target_tokens: list[str] | None,
                 listed: list[Path] = ()) -> MinionSearch:
    """Every minion the profile `listed` that suits the target, or else the best one found
    next to it or shipped (llama.cpp's GGUF before a folder, on a CPU its small models run
    faster; then the largest, the best drafter of those cheap enough)."""
    search = MinionSearch()
    for path in listed:
        _consider(path, "from the profile", target_size, target_tokens, search)
    if search.chosen:
        return search
    for path in _neighbours(target):
        _consider(path, "next to the target", target_size, target_tokens, search)
    shipped = _shipped()
    if shipped is not None and shipped.resolve() != target.resolve():
        _consider(shipped, "shipped with minions-local", target_size, target_tokens, search)
    if search.chosen:
        search.chosen = [max(search.chosen, key=lambda f: (f.kind == "gguf", f.size))]
    return search


def _consider(path: Path, where: str, target_size: int, target_tokens: list[str] | None,
              search: MinionSearch) -> None:
    from minions_local.models.vocabulary import model_tokens, tokens_differ

    kind = "gguf" if path.suffix.lower() == ".gguf" else "hf"
    size = _size(path, kind)
    if size * SMALLER_BY > target_size:
        search.passed_over.append(f"{path.name} ({size_text(size)}: more than a tenth of the target)")
        return
    try:
        tokens = model_tokens(path)
    except ModelLoadError:
        search.passed_over.append(f"{path.name} (not a readable model file)")
        return
    if target_tokens is None or tokens is None:
        problem = "its vocabulary cannot be compared without loading it"
    else:
        problem = tokens_differ(target_tokens, tokens, padded=kind == "hf")
    if problem:
        search.passed_over.append(f"{path.name} (another vocabulary: {problem})")
        return
    search.chosen.append(Found(path, size, kind, where))


def _neighbours(target: Path) -> list[Path]:
    """Models in the target's folder: .gguf files (a split model by its first shard, never
    the target's own shards) and folders with a config.json."""
    from minions_local.models.gguf_file import shard_paths

    own = {p.resolve() for p in shard_paths(target)}
    out = []
    try:
        entries = sorted(target.parent.iterdir())
    except OSError:
        return []
    for entry in entries:
        if entry.suffix.lower() == ".gguf" and entry.is_file():
            if entry.resolve() not in own and shard_paths(entry)[0] == entry:
                out.append(entry)
        elif entry.is_dir() and (entry / "config.json").is_file():
            out.append(entry)
    return out


def _size(path: Path, kind: str) -> int:
    from minions_local.models.gguf_file import shard_paths

    if kind == "gguf":
        return sum(p.stat().st_size for p in shard_paths(path) if p.is_file())
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) or sum(
        f.stat().st_size for f in path.iterdir() if f.is_file())


def _shipped() -> Path | None:
    from minions_local.models.builtin import SMOLLM2_GGUF, builtin_path

    path = builtin_path(SMOLLM2_GGUF)
    return path if path.is_file() else None


def size_text(n: int) -> str:
    """A model's size as --plan and the chat say it."""
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB"
