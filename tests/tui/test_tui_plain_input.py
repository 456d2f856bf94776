"""`minions-chat --plain` with awkward input: bytes that are not UTF-8, an empty pipe with
a wrong profile, --resume in a pipe, damaged saved conversations, a turn cut short."""

from __future__ import annotations

import io
import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.helpers.conversation_files import file_bytes, names, snapshot, write_files
from tests.helpers.fake_engine import REPLY, FakeEngine, FakeFactory

from minions_local.tui.cli import main
from minions_local.tui.store import Conversation, ConversationStore


class TTYText(io.TextIOWrapper):
    def isatty(self) -> bool:
        return True


class TTYInput(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(argv, stdin, *, factory=None, store=None):
    out, err = io.StringIO(), io.StringIO()
    factory = factory or FakeFactory()
    code = main(argv, engine_factory=factory, store=store, stdin=stdin, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue(), factory


def piped_bytes(data: bytes, errors: str = "strict") -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors=errors)


def test_a_pipe_that_is_not_utf8_is_refused_clearly(tmp_path):
    for errors in ("strict", "surrogateescape"):  # a UTF-8 locale, and Python's C-locale handling
        code, out, err, factory = run(["--plain"], piped_bytes(b"caf\xe9 au lait\n", errors),
                                      store=ConversationStore(tmp_path))
        assert code == 2 and out == "" and factory.calls == []
        assert err == ("minions-chat: stdin is not UTF-8 text (it holds the byte 0xe9). Convert it first, "
                       "e.g. `iconv -f latin1 -t utf-8 FILE | minions-chat --plain`.\n")


def test_a_terminal_line_that_is_not_utf8_is_not_sent_and_the_chat_goes_on(tmp_path):
    stdin = TTYText(io.BytesIO(b"caf\xe9\nhello\n"), encoding="utf-8", errors="surrogateescape")
    code, out, err, factory = run(["--plain"], stdin, store=ConversationStore(tmp_path))
    assert code == 0 and "that line is not UTF-8 text, so it was not sent" in err
    assert [c["messages"][-1]["content"] for c in factory.engine.calls] == ["hello"]
    code, _, err, _ = run(["--plain"], TTYText(io.BytesIO(b"caf\xe9\n"), encoding="utf-8"),
                          store=ConversationStore(tmp_path))
    assert code == 0 and "not UTF-8 text" in err and "bug" not in err


def test_an_empty_pipe_with_a_wrong_profile_reports_the_profile(tmp_path):
    code, out, err, factory = run(["--plain", "-p", "no-such-profile"], io.StringIO(""),
                                  store=ConversationStore(tmp_path))
    assert code == 1 and out == "" and factory.calls == []
    assert err.startswith("minions-chat: unknown profile 'no-such-profile'.") and err.endswith(".\n")
    assert err.count("\n") == 1 and "nothing to complete" not in err
    code, _, err, _ = run(["--plain", "-p", str(tmp_path / "missing.toml")], io.StringIO("\n"),
                          store=ConversationStore(tmp_path))
    assert code == 1 and err == f"minions-chat: profile file not found: {tmp_path / 'missing.toml'}\n"


def test_resume_in_a_pipe_continues_the_saved_conversation(tmp_path):
    store = ConversationStore(tmp_path)
    run(["--plain"], TTYInput("first\n"), store=store)
    engine = FakeEngine()
    code, out, err, _ = run(["--plain", "--resume"], io.StringIO("second\n"), factory=FakeFactory(engine), store=store)
    assert code == 0 and out == REPLY + "\n" and err == ""
    assert [m["content"] for m in engine.calls[0]["messages"]] == ["first", REPLY, "second"]
    saved = store.saved()
    assert len(saved) == 1 and [m["content"] for m in saved[0].messages] == ["first", REPLY, "second", REPLY]
    code, _, err, _ = run(["--plain", "--resume", "nothing-like-this"], io.StringIO("x"), store=store)
    assert code == 1 and "No saved conversation matches 'nothing-like-this'" in err


def test_without_resume_a_pipe_saves_nothing(tmp_path):
    store = ConversationStore(tmp_path)
    code, _, _, _ = run(["--plain"], io.StringIO("def f(\n"), store=store)
    assert code == 0 and store.saved() == []


def test_resume_says_it_skipped_a_damaged_newest_conversation(tmp_path):
    store = ConversationStore(tmp_path)
    run(["--plain"], TTYInput("first\n"), store=store)
    older = store.latest()
    os.utime(store.path(older.id), (1_000, 1_000))
    damaged = tmp_path / "20990101-000000-beef.json"
    damaged.write_text('{"messages": [{"role": "user", "content": "secret plans"}, ')
    engine = FakeEngine()
    code, _, err, _ = run(["--plain", "--resume"], TTYInput("again\n"), factory=FakeFactory(engine), store=store)
    assert code == 0
    assert f"minions-chat: Skipped the newest saved conversation, {damaged}: it is not valid JSON" in err
    assert f"resumed 'first' ({older.id}) instead" in err and "secret plans" not in err
    assert [m["content"] for m in engine.calls[0]["messages"]] == ["first", REPLY, "again"]
    assert damaged.read_text().endswith(", ")  # kept as it was


def test_resume_naming_a_wrong_shape_file_exits_1_without_a_traceback(tmp_path):
    store = ConversationStore(tmp_path)
    (tmp_path / "odd.json").write_text(json.dumps({"messages": {"role": "user", "content": "secret plans"}}))
    for stdin in (TTYInput("hi\n"), io.StringIO("hi\n")):
        code, out, err, factory = run(["--plain", "--resume", "odd"], stdin, store=store)
        assert code == 1 and out == "" and factory.calls == []
        assert err == (f"minions-chat: {tmp_path / 'odd.json'} could not be loaded: it is not a conversation: "
                       f"'messages' is an object, not a list. The file is kept as it is; fix it or move it out "
                       f"of {tmp_path}.\n")


def test_the_question_is_saved_before_the_reply_starts(tmp_path):
    store = ConversationStore(tmp_path)
    on_disk_when_asked = []

    class Watching(FakeEngine):
        def stream_chat(self, messages, **kwargs):
            on_disk_when_asked.append([m["content"] for m in store.latest().messages])
            return super().stream_chat(messages, **kwargs)

    run(["--plain"], TTYInput("one\ntwo\n"), factory=FakeFactory(Watching()), store=store)
    assert on_disk_when_asked == [["one"], ["one", REPLY, "two"]]
    run(["--plain", "--resume"], io.StringIO("three"), factory=FakeFactory(Watching()), store=store)
    assert on_disk_when_asked[-1] == ["one", REPLY, "two", REPLY, "three"]


def test_a_resumed_question_without_reply_is_taken_back(tmp_path):
    store = ConversationStore(tmp_path)
    cut = Conversation(messages=[{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                                 {"role": "user", "content": "the unanswered one"}])
    store.save(cut)
    engine = FakeEngine()
    code, _, err, _ = run(["--plain", "--resume"], TTYInput("q2\n"), factory=FakeFactory(engine), store=store)
    assert code == 0 and "(resumed 'q1' · 3 messages)" in err
    assert '(the last question had no reply and is taken back: "the unanswered one"' in err
    assert [m["content"] for m in engine.calls[0]["messages"]] == ["q1", "a1", "q2"]
    assert [m["content"] for m in store.load(cut.id).messages] == ["q1", "a1", "q2", REPLY]


# ---- random saved files at --resume (Hypothesis) ------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.lists(st.tuples(names, file_bytes), min_size=1, max_size=3), piped=st.booleans())
def test_resume_over_random_files_sends_only_clean_messages(tmp_path_factory, monkeypatch, files, piped):
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("XDG_DATA_HOME", str(home / "data"))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / "state"))
    root = ConversationStore().root
    root.mkdir(parents=True)
    (home / "outside.json").write_text("keep me")
    write_files(root, files)
    before = snapshot(root)
    engine = FakeEngine()
    stdin = io.StringIO("next question") if piped else TTYInput("next question\n")
    code, _, err, _ = run(["--plain", "--resume"], stdin, factory=FakeFactory(engine))
    assert code == 0 and "Traceback" not in err and "bug" not in err
    for call in engine.calls:
        for message in call["messages"]:
            assert set(message) == {"role", "content"} and message["role"] in ("system", "user", "assistant")
            message["content"].encode("utf-8")
        assert call["messages"][-1] == {"role": "user", "content": "next question"}
    after = snapshot(root)
    changed = {path for path in before if after.get(path) != before[path]}
    assert len(changed) <= 1  # at most the resumed conversation, which gets the new turn
    for path in changed:
        question, reply = json.loads(after[path])["messages"][-2:]
        assert question == {"role": "user", "content": "next question"}
        assert reply["role"] == "assistant" and REPLY.startswith(reply["content"])  # a saved /max may cut it
    assert (home / "outside.json").read_text() == "keep me"
    assert {p.parent for p in home.rglob("*") if p.is_file()} <= {home, root}
