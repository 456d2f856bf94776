"""The app with damaged and strange conversation files, and a turn cut short: files are
named and kept, the app never crashes, and a question is on disk before its reply."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.helpers.conversation_files import file_bytes, names, snapshot, write_files
from tests.helpers.fake_engine import REPLY, FakeEngine
from tests.helpers.tui_helpers import make_app, notes, ready, send, start, until

from minions_local.tui.bridge import log as chat_log
from minions_local.tui.screens import ConversationPicker
from minions_local.tui.store import Conversation, ConversationStore
from minions_local.tui.widgets import UserMessage



def store_of(tmp_path) -> ConversationStore:
    return ConversationStore(tmp_path / "conversations")


@pytest.mark.asyncio
async def test_resume_skips_a_damaged_newest_file_and_says_so(tmp_path):
    store = store_of(tmp_path)
    good = Conversation(title="good one", messages=[{"role": "user", "content": "q"},
                                                    {"role": "assistant", "content": "a"}])
    store.save(good)
    os.utime(store.path(good.id), (1_000, 1_000))
    damaged = store.root / "newest.json"
    damaged.write_text(json.dumps([{"role": "user", "content": "secret plans"}]))
    app = make_app(tmp_path, resume="")
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        assert app.conversation.id == good.id
        shown = "\n".join(notes(app))
        assert f"Skipped the newest saved conversation, {damaged}: it is not a conversation: the top level is a " \
               f"list, not an object; resumed 'good one' ({good.id}) instead" in shown
        assert "secret plans" not in shown
    assert json.loads(damaged.read_text()) == [{"role": "user", "content": "secret plans"}]


@pytest.mark.asyncio
async def test_load_names_unreadable_files_and_a_damaged_one_asked_for(tmp_path):
    store = store_of(tmp_path)
    store.save(Conversation(messages=[{"role": "user", "content": "about cats"}]))
    (store.root / "cut.json").write_text('{"messages": [{"role": "user", "content": "secret')
    (store.root / "odd.json").write_text('{"messages": [], "temperature": "hot"}')
    app = make_app(tmp_path, FakeEngine())
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await send(pilot, "/load")
        assert isinstance(app.screen, ConversationPicker) and len(app.screen.conversations) == 1
        shown = "\n".join(notes(app))
        assert "cut.json: it is not valid JSON" in shown and "(it ends early: a write was cut short)" in shown
        assert "odd.json: it is not a conversation: 'temperature' is not a number from 0 to 2" in shown
        assert "secret" not in shown
        await pilot.press("escape")
        await send(pilot, "/load cut")
        assert any(f"{store.root / 'cut.json'} could not be loaded" in n for n in notes(app))
        assert app.is_running and app.conversation.messages == []


@pytest.mark.asyncio
async def test_an_unexpected_error_in_a_command_is_a_message_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    app = make_app(tmp_path, FakeEngine())

    def broken():
        raise KeyError("secret plans")

    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        monkeypatch.setattr(app.store, "scan", broken)
        await send(pilot, "/load")
        assert app.is_running
        assert any("Unexpected error while running /load: KeyError" in n for n in notes(app))


@pytest.mark.asyncio
async def test_the_question_is_on_disk_before_the_reply_starts(tmp_path):
    engine = FakeEngine(gate_after=1)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await start(pilot, "will this be kept?", engine)  # the reply is under way
        saved = store_of(tmp_path).latest()
        assert saved is not None and saved.messages == [{"role": "user", "content": "will this be kept?"}]
        engine.gate.set()
        await until(pilot, lambda: not app.generating)
    assert [m["content"] for m in store_of(tmp_path).latest().messages] == ["will this be kept?", REPLY]


@pytest.mark.asyncio
async def test_a_question_left_without_reply_comes_back_into_the_box(tmp_path):
    store = store_of(tmp_path)
    cut = Conversation(messages=[{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                                 {"role": "user", "content": "asked when the app died"}])
    store.save(cut)
    engine = FakeEngine()
    app = make_app(tmp_path, engine, resume="")
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        assert app.prompt.text == "asked when the app died"
        assert len(app.query(UserMessage)) == 1 and len(app.conversation.messages) == 2
        assert any("The last question got no reply" in n for n in notes(app))
        await pilot.press("enter")
        await until(pilot, lambda: not app.generating)
        assert [m["content"] for m in engine.calls[0]["messages"]] == ["q1", "a1", "asked when the app died"]
    assert len(store.load(cut.id).messages) == 4


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.lists(st.tuples(names, file_bytes), min_size=1, max_size=3))
def test_load_over_random_files_shows_only_clean_conversations(tmp_path_factory, monkeypatch, files):
    """/load and the picker, then each readable one opened: random saved files never crash
    the app nor change a file."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("XDG_STATE_HOME", str(home / "state"))
    root = home / "conversations"
    root.mkdir()
    write_files(root, files)
    before = snapshot(root)

    async def browse() -> None:
        app = make_app(home, FakeEngine())
        async with app.run_test(size=(120, 36)) as pilot:
            await ready(pilot)
            await send(pilot, "/load")
            readable = app.screen.conversations if isinstance(app.screen, ConversationPicker) else []
            if readable:
                await pilot.press("escape")
            for number in range(1, len(readable) + 1):
                await send(pilot, f"/load {number}")
                for message in app.conversation.messages:
                    assert set(message) == {"role", "content"} and message["role"] in ("user", "assistant")
            assert app.is_running
            assert not any("Unexpected error" in n for n in notes(app))

    asyncio.run(browse())
    assert snapshot(root) == before


@pytest.mark.asyncio
async def test_a_crash_shows_one_line_without_local_variables(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    app = make_app(tmp_path, FakeEngine())

    def broken() -> None:
        conversation_text = "words from the chat"  # noqa: F841  (Textual's dump would print it)
        raise KeyError("lookup")

    with pytest.raises(KeyError):
        async with app.run_test(size=(120, 36)) as pilot:
            await ready(pilot)
            app.call_later(broken)
            await pilot.pause(0.2)
    assert app.return_code == 1
    shown = " ".join(capsys.readouterr().err.split())  # the console wraps it
    assert shown.startswith("minions-chat: Unexpected error while running the chat: KeyError: 'lookup'.")
    assert "words from the chat" not in shown
    handler = chat_log.handlers[0]  # set up once per process, by the first error logged
    if hasattr(handler, "baseFilename"):
        log = Path(handler.baseFilename).read_text()
        assert "KeyError: 'lookup'" in log and "words from the chat" not in log
