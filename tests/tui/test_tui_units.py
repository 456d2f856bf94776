"""The TUI's pure parts: stats, tree rendering, slash commands, the store, `drive`."""

from __future__ import annotations

import json
import os
from io import StringIO

import pytest
from tests.helpers.fake_engine import REPLY, FakeEngine, pieces
from rich.console import Console

from minions_local.core.errors import ContextOverflowError, MinionsError
from minions_local.core.events import StepRecord, TreeSnapshot
from minions_local.tui.bridge import deferred, drive, overrides_from
from minions_local.tui.commands import CommandError, is_command, parse_command
from minions_local.tui.stats import GenerationStats, format_bytes, render_stats
from minions_local.tui.store import Conversation, ConversationStore
from minions_local.tui.tree_view import minion_colors, render_tree, show_token


def plain(renderable, width=100) -> str:
    console = Console(file=StringIO(), width=width, color_system=None)
    with console.capture() as capture:
        console.print(renderable)
    return capture.get()


def record(new_tokens, accepted, tree_size, **kw):
    return StepRecord(tree_size=tree_size, accepted=accepted, t_grow=0.01, t_verify=0.04,
                      bytes_streamed=80_000_000, depth=accepted + 1, new_tokens=new_tokens, **kw)


def test_stats_sum_records():
    stats = GenerationStats()
    stats.add(record(3, 2, 10, minion_accepted={"a": 2, "b": 1}))
    stats.add(record(1, 0, 6, minion_accepted={"a": 0}))
    assert stats.passes == 2 and stats.new_tokens == 4
    assert stats.tokens_per_pass == 2.0
    assert stats.tokens_per_second == pytest.approx(4 / 0.1)
    assert stats.stream_gbps == pytest.approx(160e6 / 0.08 / 1e9)
    assert stats.mean_tree_size == 8.0 and stats.last_tree_size == 6
    assert stats.predicted_passes == 0
    assert stats.minion_shares(["a", "b", "c"]) == {"a": 1.0, "b": 0.5, "c": 0.0}
    snap = stats.copy()
    stats.add(record(2, 1, 4, minion_accepted={"a": 1}))
    assert snap.passes == 2 and snap.minion_accepted == {"a": 2, "b": 1}
    total = GenerationStats()
    total.merge(snap)
    total.merge(stats)
    assert total.passes == 5 and total.minion_accepted["a"] == 5


def test_cost_model_predictions_are_shown_next_to_measurements():
    stats = GenerationStats()
    stats.add(record(2, 1, 4, predicted_t_verify=0.05, predicted_t_grow=0.02))
    text = plain(render_stats(stats, minion_names=[], colors={}, memory={}))
    assert "40.0 ms/pass (model 50.0)" in text and "10.0 ms/pass (model 20.0)" in text


def test_empty_stats_render_without_dividing_by_zero():
    text = plain(render_stats(GenerationStats(), minion_names=["a"], colors={}, memory={"ram": 2_500_000_000}))
    assert "appear here" in text and "2.5 GB" in text


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1_500) == "1.5 KB"
    assert format_bytes(305_000_000) == "305.0 MB"
    assert format_bytes(2e13) == "20.0 TB"


def test_tree_render_marks_accepted_path_bonus_and_proposers():
    tree = TreeSnapshot(
        tokens=[0, 1, 2, 3, 4],
        parents=[-1, 0, 1, 1, 0],
        texts=[" the", " cat", " sat", "\n", " dog"],
        proposers=[[], ["a", "b"], ["a"], ["b"], ["ngram"]],
        scores=[1.0, 0.9, 0.6, 0.2, 0.1],
        accepted_path=[0, 1, 2],
        bonus_text=" on",
    )
    text = plain(render_tree(tree, minion_colors(["a", "b", "ngram"]), pass_number=7))
    assert "Pass 7 · 4 draft nodes · 2 accepted + 1 bonus" in text
    assert "accepted: ␣cat␣sat␣on" in text
    lines = text.splitlines()
    cat = next(i for i, line in enumerate(lines) if "␣cat" in line and "✓" in line)
    assert "●●" in lines[cat] and "90%" in lines[cat]
    assert any("★" in line and "␣on" in line for line in lines[cat:])
    assert any("⏎" in line and "✓" not in line for line in lines)
    assert plain(render_tree(None, {})).startswith("No tree yet")


def test_show_token_makes_whitespace_visible():
    assert show_token(" a\tb\n") == "␣a⇥b⏎"
    assert show_token("") == "∅"


def test_minion_colors_are_stable():
    assert minion_colors(["x", "y", "z"])["y"] == minion_colors(["x", "y"])["y"]
    assert len(set(minion_colors(["a", "b", "c", "d"]).values())) == 4


def test_parse_commands():
    assert parse_command("/temp 0.7").value == 0.7
    assert parse_command("/max 512").value == 512
    assert parse_command("/system  Be brief. ").arg == "Be brief."
    assert parse_command("/q").name == "quit"
    assert parse_command("/HELP").name == "help"
    assert is_command("/new") and not is_command("//not a command") and not is_command("hi")
    for bad, hint in [("/temp", "Usage: /temp"), ("/temp 9", "between 0 and 2"),
                      ("/max x", "Usage: /max"), ("/sytem x", "Did you mean /system")]:
        with pytest.raises(CommandError, match=hint):
            parse_command(bad)


def test_store_saves_atomically_and_lists_newest_first(tmp_path):
    store = ConversationStore(tmp_path / "c")
    first = Conversation(messages=[{"role": "user", "content": "about cats\nand dogs"}])
    second = Conversation(title="Rust help", messages=[{"role": "user", "content": "x"}])
    store.save(first)
    store.save(second)
    os.utime(store.path(first.id), None)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == sorted([f"{first.id}.json", f"{second.id}.json"])
    data = json.loads(store.path(first.id).read_text())
    assert data["version"] == 1 and data["messages"][0]["content"] == "about cats\nand dogs"
    assert store.find("about").id == first.id
    assert store.find("rust").id == second.id
    assert store.find(first.id).display_title() == "about cats"
    with pytest.raises(MinionsError, match="No saved conversation matches"):
        store.find("zebra")


def test_store_skips_damaged_files_and_failed_writes_leave_no_temp(tmp_path, monkeypatch):
    store = ConversationStore(tmp_path)
    (tmp_path / "broken.json").write_text("{not json")
    good = Conversation(messages=[{"role": "user", "content": "hi"}])
    store.save(good)
    assert [c.id for c in store.saved()] == [good.id]
    with pytest.raises(MinionsError, match="broken.json could not be loaded: it is not valid JSON"):
        store.load("broken")

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    good.messages.append({"role": "assistant", "content": "hello"})
    with pytest.raises(MinionsError, match="No space left"):
        store.save(good)
    assert not list(tmp_path.glob(".tmp*"))
    assert len(store.load(good.id).messages) == 1  # the old file is intact


def test_default_store_follows_xdg_data_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert ConversationStore().root == tmp_path / "minions-local" / "conversations"


def test_engine_messages_put_system_first():
    c = Conversation(system="Be brief.", messages=[{"role": "user", "content": "hi"}])
    assert c.engine_messages() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def test_drive_collects_text_stats_and_finish_reason():
    engine = FakeEngine()
    texts = []
    outcome = drive(engine.stream_chat([{"role": "user", "content": "hi"}]), on_text=texts.append)
    assert outcome.text == REPLY == "".join(texts)
    assert outcome.reason == "stop" and outcome.generation is not None
    assert outcome.stats.new_tokens == len(pieces(REPLY))


def test_drive_cancel_closes_the_stream_within_one_pass():
    engine = FakeEngine()
    seen = []
    outcome = drive(engine.stream("x"), on_text=seen.append, cancelled=lambda: len(seen) >= 2)
    assert outcome.reason == "cancelled" and engine.closed_early == 1
    assert outcome.stats.passes == 2


def test_drive_turns_errors_into_messages(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    engine = FakeEngine(fail_after=1, fail_with=ContextOverflowError("Too long: use /new."))
    outcome = drive(engine.stream("x"), on_text=lambda t: None)
    assert outcome.reason == "error" and outcome.error == "Too long: use /new."
    assert outcome.text == pieces(engine.completion)[0]

    def eager():
        raise ContextOverflowError("raised before any work")

    outcome = drive(deferred(eager), on_text=lambda t: None)
    assert outcome.error == "raised before any work"
    outcome = drive(deferred(lambda: iter([1 / 0])), on_text=lambda t: None)
    assert "ZeroDivisionError" in outcome.error and "bug" in outcome.error


def test_overrides_only_when_given():
    assert overrides_from(None, None) == {}
    assert overrides_from("/t", ["/a"]) == {"target": "/t", "minions": ["/a"]}


def test_high_rate_messages_replace_only_their_own_kind():
    from minions_local.core.events import LoadProgress
    from minions_local.tui.messages import LoadProgressed, ReplyDelta, StatsUpdated

    tree = TreeSnapshot([0], [-1], ["x"], [[]], [1.0], [0])
    older, newer = StatsUpdated(GenerationStats(), tree), StatsUpdated(GenerationStats(), None)
    assert not older.can_replace(newer)  # keep the last tree
    assert newer.can_replace(older) and older.can_replace(StatsUpdated(GenerationStats(), tree))
    assert not older.can_replace(ReplyDelta("text"))
    ram = LoadProgressed(LoadProgress("target", "ram", 1, 4))
    assert ram.can_replace(LoadProgressed(LoadProgress("target", "ram", 2, 4)))
    assert not ram.can_replace(LoadProgressed(LoadProgress("target", "disk", 2, 4)))


def test_the_tui_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, minions_local.tui.cli, minions_local.tui.app, minions_local.tui.plain; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
