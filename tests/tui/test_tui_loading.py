"""A message sent while the model loads: shown at once as waiting, sent when the
engine is ready, taken back with Esc or when the load fails (Pilot, fake engine)."""

from __future__ import annotations

import threading

import pytest
from tests.helpers.fake_engine import REPLY, FakeEngine, FakeFactory
from tests.helpers.tui_helpers import error_shown, make_app, notes, text_of, until

from minions_local.core.errors import ProfileError
from minions_local.tui.widgets import AssistantMessage, LoadingPanel, Note, UserMessage

pytestmark = pytest.mark.asyncio


async def loading(pilot) -> None:
    """Wait until the load is under way (its panel shows progress), held by the factory."""
    app = pilot.app
    await until(pilot, lambda: app._loading is not None and len(app._loading._bars) >= 3)


async def test_a_message_sent_while_loading_waits_then_goes_when_the_model_is_ready(tmp_path):
    hold = threading.Event()
    engine = FakeEngine()
    app = make_app(tmp_path, factory=FakeFactory(engine, hold=hold))
    async with app.run_test(size=(120, 36)) as pilot:
        await loading(pilot)
        await pilot.press(*"hello there", "enter")
        assert app.prompt.text == ""
        waiting = app.query_one(UserMessage)
        assert waiting.has_class("waiting") and "waiting for the model" in str(waiting.border_subtitle)
        assert "hello there" in text_of(waiting)
        assert engine.calls == [] and not app.generating
        assert app.check_action("stop", ()) is True  # Esc is offered: it takes the message back

        hold.set()
        await until(pilot, lambda: bool(engine.calls) and not app.generating)
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert engine.calls[0]["messages"] == [{"role": "user", "content": "hello there"}]
        sent = app.query_one(UserMessage)  # the same message, no second copy
        assert sent is waiting and not sent.has_class("waiting") and not sent.border_subtitle
        reply = app.query(AssistantMessage).last()
        assert reply.text == REPLY and "tok/s" in text_of(reply.footer)
        # The chat reads in order: the memory plan, the question, its reply.
        log = [w for w in app.chat_log.children if not isinstance(w, LoadingPanel)]
        plan = next(i for i, w in enumerate(log) if isinstance(w, Note) and "memory plan" in w.border_title)
        assert plan < log.index(sent) < log.index(reply)
        assert app.conversation.messages == [{"role": "user", "content": "hello there"},
                                             {"role": "assistant", "content": REPLY}]


async def test_esc_takes_a_waiting_message_back_into_the_box(tmp_path):
    hold = threading.Event()
    engine = FakeEngine()
    app = make_app(tmp_path, factory=FakeFactory(engine, hold=hold))
    async with app.run_test(size=(120, 36)) as pilot:
        await loading(pilot)
        await pilot.press(*"not yet", "enter")
        assert app.query(UserMessage)
        await pilot.press("escape")
        await pilot.pause()
        assert not app.query(UserMessage) and app._waiting is None
        assert app.prompt.text == "not yet"
        hold.set()
        await until(pilot, lambda: app.engine is not None)
        await pilot.pause()
        assert engine.calls == []  # nothing went to the model


async def test_only_one_message_waits(tmp_path):
    hold = threading.Event()
    engine = FakeEngine()
    app = make_app(tmp_path, factory=FakeFactory(engine, hold=hold))
    async with app.run_test(size=(120, 36)) as pilot:
        await loading(pilot)
        await pilot.press(*"first", "enter")
        await pilot.press(*"second", "enter")
        assert app.prompt.text == "second"
        assert any("already waits" in n for n in notes(app))
        assert len(app.query(UserMessage)) == 1
        hold.set()
        await until(pilot, lambda: bool(engine.calls) and not app.generating)
        assert [c["messages"][-1]["content"] for c in engine.calls] == ["first"]
        assert app.prompt.text == "second"  # still there, to send next


async def test_a_failed_load_gives_the_waiting_message_back(tmp_path):
    hold = threading.Event()
    error = ProfileError("Profile 'huge' needs 80 GB of RAM but this machine has 24 GB. Pick a smaller profile.")
    app = make_app(tmp_path, factory=FakeFactory(fail=error, hold=hold), profile="huge")
    async with app.run_test(size=(120, 36)) as pilot:
        await loading(pilot)
        await pilot.press(*"will it load?", "enter")
        hold.set()
        await error_shown(pilot)
        await pilot.press("escape")
        await pilot.pause()
        assert not app.query(UserMessage)
        assert app.prompt.text == "will it load?"
        assert app.conversation.messages == []


async def test_a_new_conversation_keeps_the_waiting_message(tmp_path):
    hold = threading.Event()
    engine = FakeEngine()
    app = make_app(tmp_path, factory=FakeFactory(engine, hold=hold))
    async with app.run_test(size=(120, 36)) as pilot:
        await loading(pilot)
        await pilot.press(*"keep me", "enter")
        app.prompt.text = "/new"
        await pilot.press("enter")
        await pilot.pause()
        assert app.query_one(UserMessage).has_class("waiting")
        hold.set()
        await until(pilot, lambda: bool(engine.calls) and not app.generating)
        assert engine.calls[0]["messages"] == [{"role": "user", "content": "keep me"}]
