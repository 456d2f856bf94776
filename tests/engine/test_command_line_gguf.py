"""The user's path for a GGUF of their own: `--target any.gguf` on the default profile
loads it on llama.cpp with a minion found beside it, answers with the file's own chat
template and stop tokens (or a plain transcript where it has no template), says what it
chose, and refuses a file llama.cpp cannot run with a message, not a traceback."""

from __future__ import annotations

import argparse
import io

import pytest

from minions_local.core.errors import ModelLoadError
from minions_local.planning import fitting

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.gguf
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer):
    """A 5 MB target with a 60 kB minion on its tokenizer beside it; the same target
    without a chat template, and under an architecture llama.cpp does not know."""
    from tests.helpers.tiny_gguf import write_gguf
    from tests.helpers.tiny_models import random_model, save, tiny_config

    root = tmp_path_factory.mktemp("own_gguf")
    big = save(random_model(tiny_config("llama", hidden=256, layers=4, ctx=1024), seed=7, scale=4.0),
               root / "src-target", tokenizer)
    small = save(random_model(tiny_config("llama", hidden=64, layers=1), seed=8), root / "src-minion", tokenizer)
    for folder in ("mine", "plain", "foreign"):
        (root / folder).mkdir()
    return {"target": write_gguf(big, root / "mine" / "target.gguf", "F16"),
            "minion": write_gguf(small, root / "mine" / "small.gguf", "Q8_0"),
            "plain": write_gguf(big, root / "plain" / "target.gguf", "F16", chat_template=False),
            "foreign": write_gguf(big, root / "foreign" / "target.gguf", "F16", architecture="foo")}


@pytest.fixture(autouse=True)
def no_substitute(monkeypatch, tmp_path):
    """The profile's substitute would be the tiny target re-quantized by llama.cpp: left out here."""
    monkeypatch.setattr(fitting, "SUBSTITUTE_BELOW", 0)
    monkeypatch.setenv("MINIONS_CACHE_DIR", str(tmp_path / "cache"))


def test_the_default_profile_runs_a_gguf_named_on_the_command_line(files):
    from minions_local.engine import Engine

    engine = Engine.from_profile("cpu-demo", target=str(files["target"]))
    assert engine.minion_names == ["small", "ngram"]
    assert any("minion small: " in line and "next to the target" in line for line in engine.memory_plan.choices())
    assert "memory: " in engine.memory_plan_text()
    template = engine.tokenizer.chat_template
    assert template and "assistant:" in template  # the file's own
    prepared = engine.prepare_chat(MESSAGES)
    assert prepared.ids == engine.tokenizer.encode("<s>user: hello world\n<s>assistant:", add_special_tokens=False)
    assert 2 in engine.eos_ids  # the file's </s>
    got = engine.chat(MESSAGES, max_new_tokens=12)
    alone = Engine.from_pretrained(files["target"], [])
    assert got.token_ids == alone.chat(MESSAGES, max_new_tokens=12).token_ids


def test_a_gguf_without_a_chat_template_chats_as_a_transcript(files):
    from minions_local.engine import Engine

    engine = Engine.from_profile("cpu-demo", target=str(files["plain"]))
    assert engine.tokenizer.chat_template is None
    assert engine.minion_names == ["ngram"]  # nothing beside it
    assert engine.prepare_chat(MESSAGES).ids == engine.tokenizer.encode("User: hello world\n\nAssistant:")
    assert engine.chat(MESSAGES, max_new_tokens=6).finish_reason in ("length", "stop")


def test_the_chat_and_the_server_say_what_they_chose(files):
    from minions_local.server.cli import load_engine
    from minions_local.tui.cli import main

    out, err = io.StringIO(), io.StringIO()
    assert main(["--plain", "--max", "4", "--target", str(files["target"])], stdin=io.StringIO("hello"),
                stdout=out, stderr=err) == 0
    assert out.getvalue().endswith("\n") and "minions-chat: minion small: " in err.getvalue()
    err = io.StringIO()
    load_engine(argparse.Namespace(profile="cpu-demo", target=str(files["target"]), minions=None), err)
    assert "minions-serve: memory: " in err.getvalue() and "minions-serve: minion small: " in err.getvalue()


def test_an_architecture_llama_cpp_does_not_know_is_named(files, capfd):
    from minions_local.backends.llama_load import load_llama_target
    from minions_local.planning.report import plan_report

    want = r"llama.cpp cannot run .*target.gguf: its architecture 'foo' is not one this llama.cpp knows"
    with pytest.raises(ModelLoadError, match=want):
        plan_report("cpu-demo", target=str(files["foreign"]))
    assert capfd.readouterr().err == ""  # asked in this process: llama.cpp's own lines are not printed
    with pytest.raises(ModelLoadError, match=want):
        load_llama_target(files["foreign"], context_tokens=256)
