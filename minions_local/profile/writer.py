"""Writing a profile as TOML (what autotune produces; read back by load_profile).

A small writer for the shapes a profile has: scalars, inline tables for small maps
(`compute_tflops`), tables, arrays of tables, nested tables under array entries.
"""

from __future__ import annotations

import json
import math
from typing import Any

INLINE = frozenset({"compute_tflops"})


def dumps(data: dict[str, Any], header: str = "") -> str:
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    _table(data, [], lines)
    return "\n".join(lines).strip() + "\n"


def _table(data: dict[str, Any], path: list[str], lines: list[str]) -> None:
    subtables, arrays = [], []
    for key, value in data.items():
        if value is None:
            continue
        if isinstance(value, dict) and key not in INLINE:
            subtables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            arrays.append((key, value))
        else:
            lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in subtables:
        lines += ["", f"[{'.'.join(map(_key, path + [key]))}]"]
        _table(value, path + [key], lines)
    for key, items in arrays:
        for item in items:
            lines += ["", f"[[{'.'.join(map(_key, path + [key]))}]]"]
            _table(item, path + [key], lines)


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write {value} to a profile")
        text = f"{value:.6g}"  # six significant digits, also for microsecond timings
        return text if any(c in text for c in ".e") else text + ".0"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to a profile")
