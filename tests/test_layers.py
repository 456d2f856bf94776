"""The layering rules the README's "How it is built" states, checked on the source.

Each layer may import only the layers below it. A lower layer that needed a higher
one would make the stack a tangle again (backends and speculation once imported each
other); this test names the file and the import that broke the rule.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top. A module belongs to the layer of its package.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("minions_local.core",)),
    ("models", ("minions_local.models",)),
    ("profile", ("minions_local.profile",)),
    ("offload", ("minions_local.offload",)),
    ("backends", ("minions_local.backends",)),
    ("speculation", ("minions_local.speculation",)),
    ("planning", ("minions_local.planning",)),
    ("engine", ("minions_local.engine",)),
    ("front ends", ("minions_local.tui", "minions_local.server")),
]


def layer_of(module: str) -> int | None:
    for rank, (_, packages) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return rank
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "tui":
        parts = ["minions_local", "tui"] + parts[1:]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> list[Path]:
    files = sorted((ROOT / "minions_local").rglob("*.py")) + sorted((ROOT / "tui").rglob("*.py"))
    return [f for f in files if module_name(f) != "minions_local"]  # the package's lazy facade


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module)]
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def test_every_module_has_a_layer():
    assert [module_name(f) for f in sources() if layer_of(module_name(f)) is None] == []


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down_the_layers(path):
    own = layer_of(module_name(path))
    broken = []
    for line, target in imports(path):
        theirs = layer_of(target)
        if target.startswith("minions_local") and theirs is not None and theirs > own:
            broken.append(f"line {line}: a {LAYERS[own][0]} module imports {target} ({LAYERS[theirs][0]})")
    assert broken == []


@pytest.mark.parametrize("folder", ["tui", "minions_local/server"])
def test_front_ends_never_import_torch(folder):
    # The chat and the server start in a moment and stay responsive: torch loads only
    # when the engine does, behind the engine layer.
    users = [f"{f.relative_to(ROOT)}:{line}" for f in sorted((ROOT / folder).rglob("*.py"))
             for line, target in imports(f) if target == "torch" or target.startswith("torch.")]
    assert users == []


def test_modules_stay_small():
    long = [f"{f.relative_to(ROOT)} ({n} lines)" for f in sources() if (n := len(f.read_text().splitlines())) > 500]
    assert long == []


def test_scripts_and_tests_never_edit_the_import_path():
    # Helpers are packages (scripts/benchmarks, tests/helpers...); pytest's pythonpath
    # setting and running a script from scripts/ put them on the path.
    edit = re.compile(r"sys\.path\.(insert|append)\(")
    edits = [str(f.relative_to(ROOT)) for folder in ("scripts", "tests") for f in (ROOT / folder).rglob("*.py")
             if edit.search(f.read_text())]
    assert edits == []
