"""Conversation files: the file name is the id, and a damaged or strange file is named,
kept, and never crashes a listing, a load or a save; random files (Hypothesis) give only
clean messages and never change anything outside the folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.helpers.conversation_files import file_bytes, names, snapshot, write_files

from minions_local.core.errors import MinionsError
from minions_local.tui.store import (Conversation, ConversationFileError, ConversationStore, is_valid_id,
                                     skipped_note)


def write(folder: Path, name: str, data) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def test_the_file_name_is_the_id_and_an_id_inside_cannot_move_a_save(tmp_path):
    root, outside = tmp_path / "data" / "conversations", tmp_path / "x.json"
    write(root, "mine.json", {"id": "../../x", "messages": [{"role": "user", "content": "hi"}]})
    store = ConversationStore(root)
    conversation = store.load("mine")
    assert conversation.id == "mine"
    conversation.messages.append({"role": "assistant", "content": "hello"})
    assert store.save(conversation) == root / "mine.json"
    assert not outside.exists() and sorted(p.name for p in root.iterdir()) == ["mine.json"]
    assert json.loads((root / "mine.json").read_text())["id"] == "mine"


def test_a_copied_file_is_a_conversation_of_its_own(tmp_path):
    store = ConversationStore(tmp_path)
    original = Conversation(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    store.save(original)
    copy = tmp_path / "my copy (2).json"
    copy.write_bytes(store.path(original.id).read_bytes())  # its JSON still says the original's id
    forked = store.load("my copy (2)")
    forked.messages.append({"role": "user", "content": "only in the copy"})
    store.save(forked)
    assert len(store.load(original.id).messages) == 2  # the original keeps its turns
    assert len(store.load("my copy (2)").messages) == 3
    assert Conversation().id != Conversation().id


@pytest.mark.parametrize("query", ["../x", "a/b", ".hidden", "..", "", "a\x00b", "a\\b", "x" * 200, "\udcff"],
                         ids=["parent", "folder", "hidden", "dotdot", "empty", "nul", "backslash", "long", "surrogate"])
def test_ids_that_would_be_paths_are_refused(tmp_path, query):
    store = ConversationStore(tmp_path / "c")
    assert not is_valid_id(query)
    with pytest.raises(MinionsError, match="is not a conversation id"):
        store.path(query)
    with pytest.raises(MinionsError, match="is not a conversation id"):
        store.save(Conversation(id=query))
    assert list(tmp_path.rglob("*")) == []


@pytest.mark.parametrize("content, reason", [
    ('{"messages": [{"role": "user", "content": "hi"}', "it is not valid JSON: Expecting ',' delimiter at line 1"
                                                        " column 48 (it ends early: a write was cut short)"),
    ("", "it is not valid JSON"),
    ("[1, 2]", "it is not a conversation: the top level is a list, not an object"),
    ('"just text"', "the top level is text, not an object"),
    ("{}", "it has no 'messages'"),
    ('{"messages": {"role": "user"}}', "'messages' is an object, not a list"),
    ('{"messages": ["hi"]}', "message 1 is text, not an object"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]}',
     "message 2 has no role 'user' or 'assistant'"),
    ('{"messages": [{"role": "user", "content": 5}]}', "message 1 has no text 'content'"),
    ('{"messages": [{"role": "user", "content": "\\udcff"}]}', "message 1 has no text 'content'"),
    ('{"messages": [], "title": ["secret words"]}', "'title' is a list, not text"),
    ('{"messages": [], "updated": 5}', "'updated' is a number, not text"),
    ('{"messages": [], "temperature": "hot"}', "'temperature' is not a number from 0 to 2"),
    ('{"messages": [], "temperature": NaN}', "'temperature' is not a number from 0 to 2"),
    ('{"messages": [], "max_new_tokens": 2.5}', "'max_new_tokens' is not a whole number"),
    ('{"messages": [], "version": 7}', "written by a newer minions-local (format 7"),
    ('{"messages": [], "version": "1"}', "its 'version' is not a format this program knows"),
    ("[" * 100_000, "it is not JSON that can be read (RecursionError)"),
    ('{"messages": [], "max_new_tokens": 1' + "0" * 5000 + "}", "it is not JSON that can be read (ValueError)"),
], ids=lambda text: text[:40])
def test_damaged_and_wrong_shape_files_are_named_and_kept(tmp_path, content, reason):
    store = ConversationStore(tmp_path)
    path = write(tmp_path, "bad.json", content)
    before = path.read_bytes()
    with pytest.raises(ConversationFileError) as err:
        store.load("bad")
    message = str(err.value)
    assert f"{path} could not be loaded: " in message and reason in message
    assert "secret words" not in message and "The file is kept as it is" in message
    scan = store.scan()
    assert scan.conversations == [] and [p.path for p in scan.problems] == [path]
    assert path.read_bytes() == before


def test_bytes_that_are_not_utf8_and_things_that_are_not_files(tmp_path):
    store = ConversationStore(tmp_path)
    (tmp_path / "latin.json").write_bytes(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}')
    (tmp_path / "folder.json").mkdir()
    os.mkfifo(tmp_path / "pipe.json")  # reading it would wait forever
    (tmp_path / "bad:name.json").write_text('{"messages": []}')
    reasons = {p.path.name: p.reason for p in store.scan().problems}
    assert reasons["latin.json"] == "it is not UTF-8 text (byte 46)"
    assert reasons["folder.json"] == reasons["pipe.json"] == "it is not a regular file"
    assert "its name cannot be a conversation id" in reasons["bad:name.json"]


def test_listing_is_newest_file_first_and_resume_says_what_it_skipped(tmp_path):
    store = ConversationStore(tmp_path)
    old, new = Conversation(title="old"), Conversation(title="new")
    store.save(old)
    store.save(new)
    os.utime(store.path(old.id), (1_000, 1_000))
    os.utime(store.path(new.id), (2_000, 2_000))
    assert [c.title for c in store.saved()] == ["new", "old"] and store.latest().title == "new"
    assert store.latest_readable() == (store.load(new.id), [])
    broken = write(tmp_path, "newest.json", '{"messages": [')
    os.utime(broken, (3_000, 3_000))
    resumed, skipped = store.latest_readable()
    assert resumed.title == "new" and [p.path for p in skipped] == [broken]
    note = skipped_note(skipped, resumed)
    assert note.startswith(f"Skipped the newest saved conversation, {broken}: it is not valid JSON")
    assert f"resumed 'new' ({new.id}) instead" in note
    os.utime(broken, (500, 500))  # an old damaged file is not news on --resume
    assert store.latest_readable()[1] == []
    assert "starting a new conversation" in skipped_note(skipped, None)


def test_an_unanswered_question_is_taken_back(tmp_path):
    conversation = Conversation(messages=[{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a"},
                                          {"role": "user", "content": "q2"}])
    assert conversation.unanswered() == "q2" and len(conversation.messages) == 2
    assert conversation.unanswered() is None


def test_text_that_cannot_be_written_is_refused_before_the_file_is_touched(tmp_path):
    store = ConversationStore(tmp_path)
    conversation = Conversation(messages=[{"role": "user", "content": "fine"}])
    store.save(conversation)
    before = store.path(conversation.id).read_bytes()
    conversation.messages.append({"role": "user", "content": "bad \udcff byte"})
    with pytest.raises(MinionsError, match="not valid Unicode"):
        store.save(conversation)
    assert store.path(conversation.id).read_bytes() == before and not list(tmp_path.glob(".tmp*"))


# ---- random files (Hypothesis) --------------------------------------------------------------

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.lists(st.tuples(names, file_bytes), min_size=1, max_size=4))
def test_random_files_give_only_clean_conversations_and_touch_nothing_else(tmp_path_factory, files):
    home = tmp_path_factory.mktemp("home")
    outside = home / "outside.json"
    outside.write_text("keep me")
    root = home / "data" / "conversations"
    root.mkdir(parents=True)
    write_files(root, files)
    store = ConversationStore(root)
    originals = snapshot(root)
    scan = store.scan()
    for conversation in scan.conversations:
        assert is_valid_id(conversation.id) and (root / f"{conversation.id}.json").is_file()
        for message in conversation.messages:
            assert set(message) == {"role", "content"} and message["role"] in ("user", "assistant")
            assert isinstance(message["content"], str)
            message["content"].encode("utf-8")
        assert isinstance(conversation.title, str) and isinstance(conversation.updated, str)
        conversation.display_title()
    for problem in scan.problems:
        assert str(problem).startswith(f"{problem.path} could not be loaded: ")
    assert snapshot(root) == originals  # reading changes nothing
    resumed, _ = store.latest_readable()
    for query in ["1", "../outside", "../../outside", *[name for name, _ in files]]:
        try:
            store.find(query)
        except ConversationFileError as err:
            assert err.path.parent == root
        except MinionsError:
            pass
    if resumed is not None:
        resumed.messages.append({"role": "user", "content": "more"})
        assert store.save(resumed).parent == root
    assert outside.read_text() == "keep me"
    assert {p.parent for p in home.rglob("*") if p.is_file()} <= {home, root}
