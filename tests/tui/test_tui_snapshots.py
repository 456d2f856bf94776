"""Snapshots of the main screens (pytest-textual-snapshot). The fake engine's records
carry fixed timings, so every number on screen is reproducible.

Regenerate after a deliberate UI change: pytest tests/test_tui_snapshots.py --snapshot-update
"""

from __future__ import annotations

import threading

from tests.helpers.fake_engine import FakeEngine, FakeFactory
from tests.helpers.tui_helpers import error_shown, make_app, ready, send, until

from minions_local.core.errors import ProfileError

SIZE = (130, 40)


def test_loading_screen(snap_compare, tmp_path):
    hold = threading.Event()  # never set: the load stays at 40% of the disk tier
    app = make_app(tmp_path, factory=FakeFactory(hold=hold))

    async def loading(pilot):
        await until(
            pilot,
            lambda: app._loading is not None and ("target", "disk") in app._loading._bars,
        )
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=loading)


def test_chat_after_a_reply(snap_compare, tmp_path):
    app = make_app(tmp_path, FakeEngine())

    async def chat(pilot):
        await ready(pilot)
        await send(pilot, "Write a function that adds two numbers")

    assert snap_compare(app, terminal_size=SIZE, run_before=chat)


def test_tree_view(snap_compare, tmp_path):
    app = make_app(tmp_path, FakeEngine(reply="def add(a, b):\n    return a + b\n"))

    async def tree(pilot):
        await ready(pilot)
        await send(pilot, "add")
        await pilot.press("ctrl+t")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=tree)


def test_help(snap_compare, tmp_path):
    app = make_app(tmp_path, FakeEngine())

    async def help_note(pilot):
        await ready(pilot)
        await send(pilot, "/help")

    assert snap_compare(app, terminal_size=SIZE, run_before=help_note)


def test_load_error_screen(snap_compare, tmp_path):
    error = ProfileError(
        "Profile 'rtx4090-70b' needs 38.2 GB of host RAM for the streamed layers but this "
        "machine has 24.0 GB. Use a smaller target, a 4-bit stream (quant = \"nf4\"), or "
        "move layers to the disk tier."
    )
    app = make_app(tmp_path, factory=FakeFactory(fail=error), profile="rtx4090-70b")

    async def failed(pilot):
        await error_shown(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=failed)


def test_conversation_picker(snap_compare, tmp_path):
    import json

    folder = tmp_path / "conversations"
    folder.mkdir()
    for i, (title, when) in enumerate([("Reverse the words of a sentence", "2026-11-20T09:15:00+00:00"),
                                       ("Why is my disk tier slow?", "2026-11-21T14:02:00+00:00")]):
        data = {"version": 1, "id": f"c{i}", "title": title, "profile": "cpu-demo", "system": "",
                "temperature": 0.0, "max_new_tokens": 256, "created": when, "updated": when,
                "messages": [{"role": "user", "content": title}, {"role": "assistant", "content": "…"}]}
        (folder / f"c{i}.json").write_text(json.dumps(data))
    app = make_app(tmp_path, FakeEngine())

    async def picker(pilot):
        await ready(pilot)
        await send(pilot, "/load")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=picker)
