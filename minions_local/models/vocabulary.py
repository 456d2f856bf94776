"""A model's vocabulary read from its files, without loading it: whether a minion speaks
the target's tokens can be known before either model loads (`--plan`, choosing minions).

A GGUF lists its tokens in its metadata (`tokenizer.ggml.tokens`, by id); a Hugging Face
folder in tokenizer.json (the model's vocabulary plus its added tokens) or vocab.json.
Both write a token as the tokenizer stores it (byte-level BPE's 'Ġthe', SentencePiece's
'▁the'), so the lists compare as they are. A converter may pad a GGUF's list to its
embedding's rows ('[PAD123]'), so a folder's list is compared on the ids it has.
"""

from __future__ import annotations

import json
from pathlib import Path

from minions_local.core.errors import VocabularyMismatchError


def model_tokens(path: str | Path) -> list[str] | None:
    """Token text by id of the model at `path` (a .gguf, or an HF folder), or None
    where its files do not say (the loaders' own check decides then)."""
    path = Path(path).expanduser()
    if path.suffix.lower() == ".gguf":
        from minions_local.models.gguf_file import read_model

        tokens = read_model(path).metadata.get("tokenizer.ggml.tokens")
        return list(tokens) if isinstance(tokens, list) else None
    return _folder_tokens(path) if path.is_dir() else None


def _folder_tokens(folder: Path) -> list[str] | None:
    try:
        if (folder / "tokenizer.json").is_file():
            data = json.loads((folder / "tokenizer.json").read_text())
            vocab = data.get("model", {}).get("vocab")
            if isinstance(vocab, list):  # a Unigram model: [piece, score] by id
                by_id = {i: entry[0] for i, entry in enumerate(vocab)}
            elif isinstance(vocab, dict):
                by_id = {int(i): t for t, i in vocab.items()}
            else:
                return None
            by_id.update({int(a["id"]): a["content"] for a in data.get("added_tokens", [])})
        elif (folder / "vocab.json").is_file():
            by_id = {int(i): t for t, i in json.loads((folder / "vocab.json").read_text()).items()}
        else:
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not by_id or set(by_id) != set(range(len(by_id))):
        return None  # ids with gaps: not a list this comparison can trust
    return [by_id[i] for i in range(len(by_id))]


def tokens_differ(target: list[str], minion: list[str], *, padded: bool = False) -> str:
    """'' when `minion` names every id as `target` does, else how they differ. `padded`:
    one list may run past the other (a folder's against a GGUF's padded one)."""
    if not padded and len(target) != len(minion):
        return f"{len(target)} tokens against {len(minion)}"
    for i, (a, b) in enumerate(zip(target, minion)):
        if a != b:
            return f"token {i} is {a!r} in the target, {b!r} in the minion"
    return ""


def check_same_tokens(target_path: str | Path, minion_path: str | Path) -> None:
    """VocabularyMismatchError when both models' files list their tokens and they differ."""
    target, minion = model_tokens(target_path), model_tokens(minion_path)
    if target is None or minion is None:
        return
    gguf_pair = all(str(p).lower().endswith(".gguf") for p in (target_path, minion_path))
    problem = tokens_differ(target, minion, padded=not gguf_pair)
    if problem:
        raise mismatch(target_path, len(target), minion_path, len(minion), problem)


def mismatch(target_path: str | Path, target_size: int, minion_path: str | Path, minion_size: int,
             detail: str = "") -> VocabularyMismatchError:
    """The error a minion off the target's vocabulary gets, wherever it is found out."""
    same_size = " (a different token mapping" + (f": {detail}" if detail else "") + ")"
    return VocabularyMismatchError(
        f"The minion {minion_path} does not share the target's vocabulary: target {target_path} has "
        f"{target_size} tokens, minion has {minion_size}{same_size if target_size == minion_size else ''}. "
        f"Use minions trained on the target's tokenizer (same model family).")
