"""`minions-chat --plain` and the command line, with the fake engine and patched stdio."""

from __future__ import annotations

import io
import sys
import types

import pytest
from tests.helpers.fake_engine import COMPLETION, REPLY, FakeEngine, FakeFactory

from minions_local.core.errors import ProfileError
from minions_local.tui.cli import main
from minions_local.tui.store import ConversationStore


class TTYInput(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(argv, stdin_text="", *, tty=False, factory=None, store=None):
    stdin = TTYInput(stdin_text) if tty else io.StringIO(stdin_text)
    out, err = io.StringIO(), io.StringIO()
    factory = factory or FakeFactory()
    code = main(argv, engine_factory=factory, store=store, stdin=stdin, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue(), factory


def test_piped_prompt_prints_only_the_completion(tmp_path):
    code, out, err, factory = run(["--plain"], "def f(\n", store=ConversationStore(tmp_path))
    assert code == 0
    assert out == COMPLETION
    assert factory.engine.calls == [{"prompt": "def f(", "max_new_tokens": 256, "temperature": 0.0}]
    assert err == ""  # stderr is not a terminal: no progress lines


def test_a_piped_question_to_a_chat_model_is_answered_through_its_template(tmp_path):
    engine = FakeEngine()
    engine.tokenizer = types.SimpleNamespace(chat_template="{{ messages }}")
    code, out, _, _ = run(["--plain"], "What is 2+2?\n", factory=FakeFactory(engine), store=ConversationStore(tmp_path))
    assert code == 0 and out == REPLY + ("" if REPLY.endswith("\n") else "\n")
    assert engine.calls == [{"messages": [{"role": "user", "content": "What is 2+2?"}], "max_new_tokens": 256,
                             "temperature": 0.0}]


def test_pipe_without_plain_flag_also_completes(tmp_path):
    code, out, _, _ = run(["--max", "2", "--temp", "0.5"], "def f(\n", store=ConversationStore(tmp_path))
    assert code == 0
    assert out == "a, b):\n"


def test_empty_stdin_is_an_error(tmp_path):
    code, out, err, factory = run(["--plain"], "\n", store=ConversationStore(tmp_path))
    assert code == 2 and out == "" and "nothing to complete" in err
    assert factory.calls == []  # no model is loaded for nothing


def test_load_error_is_one_readable_line(tmp_path):
    factory = FakeFactory(fail=ProfileError("Profile 'nope' is unknown. Known profiles: cpu-demo."))
    code, out, err, _ = run(["--plain", "-p", "nope"], "x", factory=factory, store=ConversationStore(tmp_path))
    assert code == 1 and out == ""
    assert err.strip() == "minions-chat: Profile 'nope' is unknown. Known profiles: cpu-demo."


def test_unexpected_load_error_has_no_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    factory = FakeFactory(fail=KeyError("weights"))
    code, _, err, _ = run(["--plain"], "x", factory=factory, store=ConversationStore(tmp_path))
    assert code == 1
    assert "Unexpected error while loading: KeyError" in err and "Traceback" not in err


def test_overrides_reach_the_engine_factory(tmp_path):
    _, _, _, factory = run(
        ["--plain", "--profile", "box.toml", "--target", "/models/big", "--minion", "/m/a", "--minion", "ngram"],
        "x",
        store=ConversationStore(tmp_path),
    )
    assert factory.calls == [("box.toml", {"target": "/models/big", "minions": ["/m/a", "ngram"]})]


def test_repl_chats_with_commands_and_saves(tmp_path):
    store = ConversationStore(tmp_path)
    session = "/temp 0.3\n/system Be terse.\nhello\nmore\\\nlines\n/bogus\n/quit\n"
    code, out, err, factory = run(["--plain"], session, tty=True, store=store)
    assert code == 0
    calls = factory.engine.calls
    assert [c["messages"][-1]["content"] for c in calls] == ["hello", "more\nlines"]
    assert calls[0]["messages"][0] == {"role": "system", "content": "Be terse."}
    assert calls[1]["messages"][2] == {"role": "assistant", "content": REPLY}
    assert calls[0]["temperature"] == 0.3
    assert out.count(REPLY) == 2
    assert "tok/pass" in err and "Unknown command /bogus" in err
    saved = store.latest()
    assert saved is not None and len(saved.messages) == 4


def test_repl_takes_triple_quoted_blocks(tmp_path):
    session = '"""first line\n\n  indented\nlast"""\n"""one line"""\n'
    _, _, _, factory = run(["--plain"], session, tty=True, store=ConversationStore(tmp_path))
    sent = [c["messages"][-1]["content"] for c in factory.engine.calls]
    assert sent == ["first line\n\n  indented\nlast", "one line"]


def test_repl_ends_at_eof(tmp_path):
    code, out, _, _ = run(["--plain"], "hi\n", tty=True, store=ConversationStore(tmp_path))
    assert code == 0 and REPLY in out


def test_repl_resume_continues_the_latest(tmp_path):
    store = ConversationStore(tmp_path)
    run(["--plain"], "first\n", tty=True, store=store)
    _, _, _, factory = run(["--plain", "--resume"], "second\n", tty=True, store=store)
    messages = factory.engine.calls[0]["messages"]
    assert [m["content"] for m in messages] == ["first", REPLY, "second"]


def test_plan_prints_the_profiles_report(monkeypatch):
    from minions_local.planning import cli

    monkeypatch.setattr(cli, "plan_report",
                        lambda name, target=None, minions=None: f"plan for {name} {target} {minions}\n")
    monkeypatch.setattr(cli, "available_profiles", lambda: ["cpu-demo", "rtx4090-70b"])
    code, out, _, factory = run(["--plan", "-p", "rtx4090-70b"])
    assert code == 0 and out == "plan for rtx4090-70b None None\n" and factory.calls == []
    # --target and --minion reach the plan, as they reach the chat's engine.
    code, out, _, _ = run(["--plan", "-p", "cpu-demo-disk", "--target", "x.gguf", "--minion", "ngram"])
    assert code == 0 and out == "plan for cpu-demo-disk x.gguf ['ngram']\n"
    code, out, _, _ = run(["--list-profiles"])
    assert code == 0 and out.split() == ["cpu-demo", "rtx4090-70b"]


def test_plan_reports_profile_errors(monkeypatch):
    from minions_local.planning import cli

    def plan_report(name, target=None, minions=None):
        raise ProfileError(f"No profile named '{name}'.")

    monkeypatch.setattr(cli, "plan_report", plan_report)
    code, _, err, _ = run(["--plan", "-p", "zzz"])
    assert code == 1 and "No profile named 'zzz'." in err


@pytest.mark.parametrize("argv", [["--temp", "3"], ["--max", "0"], ["--temp", "warm"]])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv, engine_factory=FakeFactory())
    assert exit_info.value.code == 2
    assert "minions-chat: error:" in capsys.readouterr().err


def test_ctrl_c_while_loading_exits_quietly(tmp_path):
    def interrupted(profile, *, progress, **overrides):
        raise KeyboardInterrupt

    code, out, err, _ = run(["--plain"], "x", factory=interrupted, store=ConversationStore(tmp_path))
    assert code == 130 and out == "" and "Traceback" not in err


def test_closed_stdout_stops_generation_quietly(tmp_path):
    class Closing(io.StringIO):
        def write(self, text):
            if self.tell() > 0:
                raise BrokenPipeError
            return super().write(text)

    factory = FakeFactory()
    out, err = Closing(), io.StringIO()
    code = main(["--plain"], engine_factory=factory, store=ConversationStore(tmp_path),
                stdin=io.StringIO("def f("), stdout=out, stderr=err)
    assert code == 0 and err.getvalue() == ""
    assert factory.engine.closed_early == 1
