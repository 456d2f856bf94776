"""Held-out prompts for the benchmark: Python code the demo family never saw.

The family trains on the standard library only (scripts/demo_family/corpus.py), so prompts
come from third-party packages in site-packages: the opening tokens of function
definitions from a fixed list of files. The selection depends only on the files'
contents: same installed versions, same prompts, in the same order.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

# (package, file inside it): big, ordinary library modules from several styles of code.
SOURCE_FILES: tuple[tuple[str, str], ...] = (
    ("numpy", "lib/_function_base_impl.py"),
    ("rich", "table.py"),
    ("pydantic", "main.py"),
    ("textual", "widget.py"),
    ("transformers", "generation/utils.py"),
    ("numpy", "_core/numeric.py"),
    ("rich", "console.py"),
    ("pydantic", "fields.py"),
    ("textual", "app.py"),
    ("transformers", "tokenization_utils_base.py"),
    ("rich", "text.py"),
    ("transformers", "modeling_utils.py"),
)


@dataclass(frozen=True)
class Prompt:
    source: str
    """'package/file.py:function' where the snippet comes from."""
    ids: list[int]
    text: str


def package_file(package: str, rel: str) -> Path | None:
    """The installed file, found without importing the package."""
    spec = importlib.util.find_spec(package)
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / rel
        if path.is_file():
            return path
    return None


def function_sources(path: Path, min_chars: int) -> list[tuple[str, str]]:
    """(name, source) of each function in the file (file order), long enough to prompt with."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # Whole lines from the `def` (decorators left out) to the end: indentation kept.
            segment = "".join(lines[node.lineno - 1: node.end_lineno])
            if len(segment) >= min_chars:
                found.append((node.lineno, node.name, segment))
    return [(name, segment) for _, name, segment in sorted(found)]


def held_out_prompts(tokenizer, count: int, prompt_tokens: int = 200, skip: int = 0) -> list[Prompt]:
    """`count` prompts of `prompt_tokens` tokens, taken round-robin over SOURCE_FILES
    (the k-th long function of each file on the k-th round), after skipping `skip`.

    Functions must be at least three times the prompt long, so the reference
    continuation is code from the same function, not the next definition.
    """
    min_chars = prompt_tokens * 3 * 4  # ~4 characters per token of code
    files = [(f"{package}/{rel}", path) for package, rel in SOURCE_FILES
             if (path := package_file(package, rel)) is not None]
    parsed: dict[str, list[tuple[str, str]]] = {}  # parsed on first use: few prompts read few files
    prompts: list[Prompt] = []
    seen = 0
    depth = 0
    while len(prompts) < count:
        if len(parsed) == len(files) and all(depth >= len(f) for f in parsed.values()):
            break  # every file exhausted
        for label, path in files:
            if len(prompts) >= count:
                break
            if label not in parsed:
                parsed[label] = function_sources(path, min_chars)
            funcs = parsed[label]
            if depth >= len(funcs):
                continue
            name, source = funcs[depth]
            # Only the head is needed: ~8 characters per token is more than any code needs.
            ids = list(tokenizer.encode(source[: prompt_tokens * 8], add_special_tokens=False))[:prompt_tokens]
            if len(ids) < prompt_tokens:
                continue
            seen += 1
            if seen <= skip:
                continue
            prompts.append(Prompt(f"{label}:{name}", ids, tokenizer.decode(ids)))
        depth += 1
    if len(prompts) < count:
        raise RuntimeError(f"only {len(prompts)} held-out prompts found in site-packages "
                           f"(wanted {count}); are numpy/rich/pydantic/textual/transformers installed?")
    return prompts
