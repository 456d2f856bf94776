"""Pilot tests of minions-chat against the fake engine: typing, streaming, stopping,
slash commands, errors, saving and resuming."""

from __future__ import annotations

import pytest
from tests.helpers.fake_engine import REPLY, FakeEngine, FakeFactory, pieces
from tests.helpers.tui_helpers import error_shown, make_app, notes, ready, send, start, text_of, until

from minions_local.core.errors import ContextOverflowError, ProfileError
from minions_local.tui.screens import ConversationPicker, ErrorScreen
from minions_local.tui.widgets import (
    AssistantMessage,
    LoadingPanel,
    MarkdownNote,
    Note,
    PromptInput,
    StatsPanel,
    TreePanel,
    UserMessage,
)

pytestmark = pytest.mark.asyncio


async def test_loads_profile_and_shows_memory_plan(tmp_path):
    factory = FakeFactory()
    app = make_app(tmp_path, factory=factory, profile="my-box", overrides={"target": "/m/t"})
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        assert factory.calls == [("my-box", {"target": "/m/t"})]
        assert not app.query(LoadingPanel)
        plan = app.query(Note).last()
        assert "memory plan" in plan.border_title
        assert "tiny-a 60 MB" in text_of(plan)
        assert "my-box · 3 minions" in app.sub_title
        stats = app.query_one(StatsPanel)
        assert stats.memory["disk"] == 1_000_000_000


async def test_typing_and_sending_streams_the_reply(tmp_path):
    engine = FakeEngine()
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await pilot.press(*"hello there")
        assert app.prompt.text == "hello there"
        await pilot.press("enter")
        assert app.prompt.text == ""
        await until(pilot, lambda: not app.generating)
        await pilot.pause()
        user = app.query(UserMessage).last()
        assert "hello there" in text_of(user)
        reply = app.query(AssistantMessage).last()
        assert reply.text == REPLY
        assert reply.body.source == REPLY
        footer = text_of(reply.footer)
        assert footer.startswith(f"{len(pieces(REPLY))} tokens")
        assert "tok/pass" in footer and "tok/s" in footer
        assert engine.calls[0]["messages"] == [{"role": "user", "content": "hello there"}]
        assert engine.calls[0]["temperature"] == 0.0
        assert app.conversation.messages[-1] == {"role": "assistant", "content": REPLY}
        panel = app.query_one(StatsPanel)
        stats = panel.stats
        assert panel.memory["device"] == 306_000_000  # re-read after the reply
        assert stats.new_tokens == len(pieces(REPLY))
        assert stats.passes > 1 and stats.accepted > 0


async def test_reply_is_streamed_in_fragments(tmp_path):
    engine = FakeEngine(gate_after=3)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await start(pilot, "hi", engine)
        reply = app.query(AssistantMessage).last()
        await until(pilot, lambda: len(reply.text) > 0 and app.query_one(StatsPanel).stats.passes == 3)
        assert REPLY.startswith(reply.text) and reply.text != REPLY
        assert app.generating
        engine.gate.set()
        await until(pilot, lambda: not app.generating)
        assert reply.text == REPLY


async def test_multiline_entry_and_history(tmp_path):
    engine = FakeEngine()
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await pilot.press("a", "ctrl+j", "b")
        assert app.prompt.text == "a\nb"
        await pilot.press("enter")
        await until(pilot, lambda: not app.generating)
        assert engine.calls[-1]["messages"][0]["content"] == "a\nb"
        # A trailing backslash continues the message instead of sending it.
        await pilot.press("c", "backslash", "enter", "d", "enter")
        await until(pilot, lambda: len(engine.calls) == 2 and not app.generating)
        assert engine.calls[-1]["messages"][-1]["content"] == "c\nd"
        prompt = app.query_one(PromptInput)
        await pilot.press("e")
        await pilot.press("up")
        assert prompt.text == "c\nd"
        await pilot.press("up")  # the cursor is on the last line: moves up first
        await pilot.press("up")
        assert prompt.text == "a\nb"
        await pilot.press("down")
        assert prompt.text == "c\nd"
        await pilot.press("down")
        assert prompt.text == "e"  # the draft comes back


async def test_escape_stops_mid_reply_and_keeps_partial(tmp_path):
    engine = FakeEngine(gate_after=2)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await start(pilot, "tell me", engine)
        await pilot.press("escape")
        engine.gate.set()  # the 'target pass' in flight finishes; then the stream is closed
        await until(pilot, lambda: not app.generating)
        await app.workers.wait_for_complete()
        reply = app.query(AssistantMessage).last()
        assert engine.closed_early == 1
        # The footer's last word is a message of its own: a loaded box may show it a tick later.
        await until(pilot, lambda: "stopped" in text_of(reply.footer))
        partial = app.conversation.messages[-1]["content"]
        assert app.conversation.messages[-1]["role"] == "assistant"
        assert REPLY.startswith(partial) and 0 < len(partial) < len(REPLY)
        assert len(pieces(partial)) <= 1 + 2 + 3  # passes 1-3: at most one pass after the stop
        # The engine is still usable: the next turn carries the partial reply.
        engine.gate_after = None
        await send(pilot, "go on")
        assert app.query(AssistantMessage).last().text == REPLY
        assert engine.calls[-1]["messages"][1] == {"role": "assistant", "content": partial}


async def test_ctrl_c_stops_then_second_press_quits(tmp_path, monkeypatch):
    monkeypatch.setattr("minions_local.tui.keys.QUIT_WINDOW", 60.0)  # a busy machine may be slow
    engine = FakeEngine(gate_after=1)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await start(pilot, "x", engine)
        await pilot.press("ctrl+c")
        assert any("Ctrl+C again" in n for n in notes(app))
        engine.gate.set()
        await until(pilot, lambda: not app.generating)
        assert app.is_running
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert not app.is_running


async def test_escape_while_idle_does_nothing(tmp_path):
    engine = FakeEngine()
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await pilot.press(*"half a thought")
        shown = len(app.query(Note)), app.sub_title
        await pilot.press("escape")
        await pilot.pause()
        # Nothing the user sees changes: the draft stays typed and focused, no message,
        # note or notification appears, and no request reaches the engine.
        assert app.prompt.text == "half a thought" and app.focused is app.prompt
        assert (len(app.query(Note)), app.sub_title) == shown
        assert not app.query(UserMessage) and not app.query(AssistantMessage)
        assert notes(app) == [] and engine.calls == []
        assert app.is_running and not app.generating


async def test_slash_commands_change_settings(tmp_path):
    engine = FakeEngine()
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await send(pilot, "/temp 0.7")
        await send(pilot, "/max 5")
        await send(pilot, "/system Answer briefly.")
        assert "temp 0.7 · max 5" in app.sub_title
        await send(pilot, "question")
        call = engine.calls[-1]
        assert call["temperature"] == 0.7 and call["max_new_tokens"] == 5
        assert call["messages"][0] == {"role": "system", "content": "Answer briefly."}
        reply = app.query(AssistantMessage).last()
        assert reply.text == "".join(pieces(REPLY)[:5])
        assert "hit /max 5" in text_of(reply.footer)
        await send(pilot, "/system off")
        await send(pilot, "again")
        assert engine.calls[-1]["messages"][0]["role"] == "user"


async def test_help_stats_tree_and_bad_commands(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await send(pilot, "/help")
        assert "/temp 0.7" in app.query(MarkdownNote).last()._markdown
        await send(pilot, "/copy")
        assert any("No reply to copy" in n for n in notes(app))
        await send(pilot, "hi")
        await send(pilot, "/copy")
        assert app.clipboard == REPLY
        await send(pilot, "/stats")
        stats_note = app.query(Note).last()
        assert stats_note.border_title == "stats"
        assert "This session" in text_of(stats_note)
        tree = app.query_one(TreePanel)
        assert not tree.display
        await send(pilot, "/tree")
        assert tree.display and tree.snapshot is not None
        await pilot.press("ctrl+t")
        assert not tree.display
        await send(pilot, "/bogus")
        await send(pilot, "/temp hot")
        await send(pilot, "/max 0")
        messages = notes(app)
        assert any("Unknown command /bogus" in m for m in messages)
        assert any("Usage: /temp" in m for m in messages)
        assert any("at least 1" in m for m in messages)


async def test_tree_panel_shows_last_verified_tree(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(140, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await pilot.press("ctrl+t")
        panel = app.query_one(TreePanel)
        tree = panel.snapshot
        assert tree is not None and panel.pass_number == app.query_one(StatsPanel).stats.passes
        assert tree.bonus_text == pieces(REPLY)[-1] or tree.bonus_text
        assert set(panel.minion_colors) == {"tiny-a", "tiny-b", "ngram"}


async def test_load_failure_shows_error_screen_without_traceback(tmp_path):
    error = ProfileError("Profile 'huge' needs 80 GB of RAM but this machine has 24 GB. Pick a smaller profile.")
    app = make_app(tmp_path, factory=FakeFactory(fail=error), profile="huge")
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await error_shown(pilot)
        assert str(error) in text_of(screen.query_one("#error-message"))
        assert "/profile NAME" in text_of(screen.query_one("#error-hint"))
        await pilot.press("escape")
        assert not isinstance(app.screen, ErrorScreen)
        assert app.query(Note).last().has_class("error")
        app.prompt.text = "hello"
        await pilot.press("enter")
        assert any("No model is loaded" in n for n in notes(app))
        assert app.prompt.text == "hello"


async def test_unexpected_load_error_is_readable(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    app = make_app(tmp_path, factory=FakeFactory(fail=RuntimeError("boom")))
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await error_shown(pilot)
        text = text_of(screen.query_one("#error-message"))
        assert "RuntimeError: boom" in text and "Traceback" not in text
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running


async def test_generation_error_keeps_partial_reply(tmp_path):
    error = ContextOverflowError("The prompt is too long for the context window. Start a /new conversation.")
    engine = FakeEngine(fail_after=2, fail_with=error)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        reply = app.query(AssistantMessage).last()
        assert "failed" in text_of(reply.footer)
        assert any("too long" in n for n in notes(app))
        assert app.conversation.messages[-1]["content"] == "".join(pieces(REPLY)[:3])


async def test_error_before_any_text_gives_the_question_back(tmp_path):
    engine = FakeEngine(fail_after=0, fail_with=ContextOverflowError("Too long."))
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await send(pilot, "a long question")
        assert app.conversation.messages == []
        assert app.prompt.text == "a long question"
        assert not app.query(UserMessage) and not app.query(AssistantMessage)
        assert any("Too long." in n for n in notes(app))


async def test_save_then_resume_reuses_conversation(tmp_path):
    engine = FakeEngine()
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await send(pilot, "first question")
        await send(pilot, "/save my chat")
    saved = list((tmp_path / "conversations").glob("*.json"))
    assert len(saved) == 1 and not list((tmp_path / "conversations").glob(".tmp*"))

    engine2 = FakeEngine()
    app2 = make_app(tmp_path, engine2, resume="")
    async with app2.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        assert app2.conversation.title == "my chat"
        assert app2.prompt.sent_history == ["first question"]  # Up recalls earlier questions
        assert [type(w) for w in app2.query("UserMessage, AssistantMessage")] == [UserMessage, AssistantMessage]
        await send(pilot, "second question")
        assert [m["content"] for m in engine2.calls[-1]["messages"]] == ["first question", REPLY, "second question"]
    assert len(list((tmp_path / "conversations").glob("*.json"))) == 1


async def test_new_and_load_commands(tmp_path):
    engine = FakeEngine()
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await send(pilot, "about cats")
        first_id = app.conversation.id
        await send(pilot, "/new")
        assert engine.resets == 1
        assert not app.query(UserMessage) and app.conversation.messages == []
        await send(pilot, "/load")
        assert isinstance(app.screen, ConversationPicker)
        await pilot.press("enter")
        await until(pilot, lambda: app.conversation.id == first_id)
        assert engine.resets == 2
        assert len(app.query(UserMessage)) == 1
        await send(pilot, "/new")
        await send(pilot, "/load about")
        assert app.conversation.id == first_id
        await send(pilot, "/load nothing-like-this")
        assert any("No saved conversation matches" in n for n in notes(app))


async def test_profile_command_lists_and_reloads(tmp_path):
    factory = FakeFactory()
    app = make_app(tmp_path, factory=factory)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await send(pilot, "/profile")
        assert "current profile: cpu-demo" in text_of(app.query(Note).last())
        factory.engine = None
        await send(pilot, "/profile other-box")
        await until(pilot, lambda: app.engine is not None)
        assert factory.calls[-1] == ("other-box", {})
        assert app.profile == "other-box"


async def test_commands_that_switch_wait_for_the_reply(tmp_path):
    engine = FakeEngine(gate_after=1)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await start(pilot, "x", engine)
        app.prompt.text = "/new"
        await pilot.press("enter")
        assert any("/new waits" in n for n in notes(app))
        assert app.conversation.messages[0]["content"] == "x"
        engine.gate.set()
        await until(pilot, lambda: not app.generating)


async def test_quit_while_loading_abandons_the_load(tmp_path):
    import threading

    hold = threading.Event()
    app = make_app(tmp_path, factory=FakeFactory(hold=hold))
    async with app.run_test(size=(120, 36)) as pilot:
        await until(pilot, lambda: app._loading is not None and len(app._loading._bars) >= 3)
        await pilot.press("ctrl+q")
        await pilot.pause()
    assert not app.is_running
    assert not hold.is_set()  # the loader stopped through its progress callback


async def test_view_follows_the_reply_until_the_user_scrolls_up(tmp_path):
    engine = FakeEngine(reply="\n\n".join(f"Paragraph {i} of a long answer." for i in range(24)))
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(100, 24)) as pilot:
        await ready(pilot)
        await send(pilot, "first")  # fills the view
        log = app.chat_log
        engine.gate_after = 4
        await start(pilot, "second", engine)
        await pilot.pause()
        assert log.max_scroll_y > 0 and log.scroll_y == log.max_scroll_y
        await pilot.press("pageup")
        await pilot.pause()
        held = log.scroll_y
        assert held < log.max_scroll_y
        engine.gate.set()
        await until(pilot, lambda: not app.generating)
        await pilot.pause()
        assert log.scroll_y == held  # the user's position is kept while text streams in
        while log.scroll_y < log.max_scroll_y:
            await pilot.press("pagedown")
            await pilot.pause()
        assert log.scroll_y == log.max_scroll_y
        engine.gate_after = None
        await send(pilot, "third")
        assert log.scroll_y == log.max_scroll_y  # following again


async def test_raw_mode_shows_replies_verbatim(tmp_path):
    code = "class A:\n    def __init__(self):\n        # not a heading\n        pass\n"
    engine = FakeEngine(reply=code)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await send(pilot, "/raw python")
        await send(pilot, "a class")
        reply = app.query(AssistantMessage).last()
        assert reply.text == code
        assert reply.body.source.startswith("``````python\n" + code)
        assert app.conversation.messages[-1]["content"] == code  # saved without the fence
        await send(pilot, "/raw off")
        await send(pilot, "again")
        assert app.query(AssistantMessage).last().body.source == code


async def test_visible_tree_is_redrawn_throttled_and_ends_on_the_last_pass(tmp_path):
    app = make_app(tmp_path, FakeEngine(reply=REPLY * 3))
    async with app.run_test(size=(140, 40)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+t")
        panel = app.query_one(TreePanel)
        draws = []
        original = panel.refresh_tree
        panel.refresh_tree = lambda: (draws.append(panel.pass_number), original())[1]
        await send(pilot, "hi")
        passes = app.query_one(StatsPanel).stats.passes
        await until(pilot, lambda: panel._pending is None)
        assert draws[-1] == passes
        assert f"Pass {passes} " in text_of(panel.query_one("#tree-body"))


async def test_quit_does_not_wait_for_a_load_that_reports_nothing(tmp_path):
    import threading
    import time

    release = threading.Event()

    def stuck(profile, *, progress, **overrides):
        release.wait(20)  # a long load step with no progress callback to interrupt it
        raise RuntimeError("released")

    app = make_app(tmp_path, factory=stuck)
    try:
        started = time.monotonic()
        async with app.run_test(size=(120, 36)) as pilot:
            await until(pilot, lambda: app._loading is not None)
            await pilot.press("ctrl+q")
        assert time.monotonic() - started < 10  # not the 20 s the load step takes
        assert not app.is_running
    finally:
        release.set()


async def test_quit_mid_reply_keeps_the_partial_reply(tmp_path):
    engine = FakeEngine(gate_after=2)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await start(pilot, "long one", engine)
        await until(pilot, lambda: bool(app.query(AssistantMessage).last().text))
        await pilot.press("ctrl+q")
    engine.gate.set()
    saved = app.store.latest()
    assert saved is not None and saved.messages[-1]["role"] == "assistant"
    assert REPLY.startswith(saved.messages[-1]["content"])


async def test_ctrl_c_copies_a_selection_instead_of_quitting(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await pilot.press(*"some text")
        await pilot.press("shift+home")
        await pilot.press("ctrl+c")
        await pilot.press("ctrl+c")
        assert app.is_running
        assert app.clipboard == "some text"


async def test_a_blank_reply_is_still_the_models_turn(tmp_path):
    engine = FakeEngine(reply="\n\n\n")
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        await send(pilot, "hm")
        await send(pilot, "again")
        roles = [m["role"] for m in engine.calls[-1]["messages"]]
        assert roles == ["user", "assistant", "user"]
        assert app.query(AssistantMessage).last().body.source == "*(only whitespace: 3 line breaks)*"
