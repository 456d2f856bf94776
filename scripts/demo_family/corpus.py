"""The demo family's text: the Python standard library every machine with Python has.

Training text is the stdlib's library source (``.py``) plus its reference docs
(``pydoc_data/topics.py``, rendered as chat exchanges so the shipped models have seen
the chat template). Third-party code in site-packages is never read for training: it
is the unseen code the family is evaluated on.

What is left out of training, and why:
- ``site-packages`` / ``dist-packages``: reserved for held-out evaluation.
- test directories (``test``, ``tests``, ``idle_test``): 60% of the stdlib's bytes,
  mostly repetitive assertion code and deliberately odd data files, unlike the
  library code users ask about; dropping them keeps the corpus library-style.
- ``__pycache__`` and files that are not valid UTF-8.
- a fixed slice of library files (chosen by a hash of their path, not by the seed)
  held out for the held-out loss.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directory names never read for training (see the module docstring).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})

# One library file in HELD_OUT_MODULUS is held out, by path hash: fixed across seeds.
HELD_OUT_MODULUS = 40

# Share of library files also shown as a chat exchange ("Show me the source of ..."),
# so that a chat request for code continues with code.
CHAT_SOURCE_MODULUS = 10

# Third-party packages sampled (read-only) for the unseen-code evaluation, when installed.
EVAL_PACKAGES = ("numpy", "pydantic", "rich", "textual", "transformers", "click", "jinja2", "requests")


@dataclass(frozen=True)
class Document:
    """One training or evaluation text with where it came from."""

    source: str  # path relative to its root, or "pydoc_data/topics.py#<topic>"
    text: str


@dataclass(frozen=True)
class StdlibCorpus:
    train: list[Document]
    held_out: list[Document]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stable_hash(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def _is_excluded(rel: Path) -> bool:
    return any(part in EXCLUDED_DIRS for part in rel.parts)


def _read_utf8(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def library_sources(root: Path, max_files: int | None = None) -> list[Document]:
    """Every stdlib library ``.py`` file (sorted by path) except the excluded ones."""
    docs: list[Document] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _is_excluded(rel) or rel.as_posix() == "pydoc_data/topics.py":
            continue
        text = _read_utf8(path)
        if text and text.strip():
            docs.append(Document(rel.as_posix(), text))
        if max_files is not None and len(docs) >= max_files:
            break
    return docs


def pydoc_topics(root: Path) -> dict[str, str]:
    """The reference docs shipped as ``pydoc_data/topics.py``, parsed, not imported."""
    path = root / "pydoc_data" / "topics.py"
    text = _read_utf8(path)
    if text is None:
        return {}
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "topics":
            return ast.literal_eval(node.value)
    return {}


def split_held_out(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    held = [d for d in docs if _stable_hash(d.source) % HELD_OUT_MODULUS == 0]
    train = [d for d in docs if _stable_hash(d.source) % HELD_OUT_MODULUS != 0]
    return train, held


def build_stdlib_corpus(max_files: int | None = None, root: Path | None = None) -> StdlibCorpus:
    """Library sources split into train / held-out; docs topics go to train."""
    root = root or stdlib_root()
    train, held = split_held_out(library_sources(root, max_files))
    topics = pydoc_topics(root)
    if max_files is not None:
        topics = dict(list(topics.items())[: max(1, max_files // 10)])
    train += [Document(f"pydoc_data/topics.py#{name}", body) for name, body in sorted(topics.items())]
    return StdlibCorpus(train=train, held_out=held)


def wants_chat_form(doc: Document) -> bool:
    """Docs topics always, a fixed tenth of source files too, appear as chat exchanges."""
    if doc.source.startswith("pydoc_data/topics.py#"):
        return True
    return _stable_hash("chat:" + doc.source) % CHAT_SOURCE_MODULUS == 0


def chat_request_for(doc: Document) -> tuple[str, str]:
    """(user message, assistant reply) that present ``doc`` as an answer."""
    if doc.source.startswith("pydoc_data/topics.py#"):
        topic = doc.source.split("#", 1)[1]
        return f"Explain the Python topic '{topic}'.", doc.text.strip()
    module = doc.source.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    return f"Show me the source of the Python module `{module}`.", f"```python\n{doc.text.rstrip()}\n```"


# ---------------------------------------------------------------------------------
# Unseen code: third-party packages, read only, never trained on.


def site_packages_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = {Path(paths["purelib"]), Path(paths["platlib"])}
    return sorted(r for r in roots if r.is_dir())


def third_party_sample(files_per_package: int, packages: tuple[str, ...] = EVAL_PACKAGES) -> list[Document]:
    """A fixed sample of third-party library files (not their tests), by path hash."""
    docs: list[Document] = []
    for root in site_packages_roots():
        for package in packages:
            pkg_dir = root / package
            if not pkg_dir.is_dir():
                continue
            candidates = [
                p for p in pkg_dir.rglob("*.py") if not _is_excluded(p.relative_to(root)) and p.stat().st_size > 2000
            ]
            candidates.sort(key=lambda p: _stable_hash(p.relative_to(root).as_posix()))
            for path in candidates[:files_per_package]:
                text = _read_utf8(path)
                if text:
                    docs.append(Document(path.relative_to(root).as_posix(), text))
    return docs
