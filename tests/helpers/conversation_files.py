"""Random conversation files for property tests (Hypothesis strategies): JSON of the
right shape with a wrong value now and then, other JSON, files cut short, raw bytes."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import strategies as st

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def mostly(good, bad=json_values):
    """Nine times in ten a value a conversation may hold, else any JSON value (so that
    whole files are often clean and each way of being wrong still comes up)."""
    return st.integers(0, 9).flatmap(lambda k: bad if k == 0 else good)


messages = st.lists(st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "assistant"]),
                                                          st.sampled_from(["system", "", 3, None])),
                                           "content": mostly(st.text(max_size=20))}), max_size=4)
conversation_like = st.fixed_dictionaries(
    {"messages": mostly(messages)},
    optional={"id": st.sampled_from(["../../escape", "/tmp/abs", "..", "ok"]) | json_values,
              "title": mostly(st.text(max_size=10)), "version": mostly(st.just(1), st.sampled_from([2, "1", None])),
              "temperature": mostly(st.floats(0, 2)), "max_new_tokens": mostly(st.integers(1, 4096)),
              "updated": mostly(st.text(max_size=10)), "system": mostly(st.text(max_size=10))},
)
file_bytes = st.one_of(
    conversation_like.map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda d: json.dumps(d).encode()),
    conversation_like.map(lambda d: json.dumps(d).encode()).flatmap(
        lambda b: st.integers(0, len(b)).map(lambda n: b[:n])),  # cut short
    st.binary(max_size=60),
)
names = st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=12).filter(
    lambda n: "/" not in n and "\x00" not in n)


def write_files(root: Path, files) -> None:
    """Write each (name, bytes) as root/name.json, skipping names the file system
    refuses (too long in bytes, say)."""
    for name, data in files:
        try:
            (root / f"{name}.json").write_bytes(data)
        except OSError:
            continue


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
