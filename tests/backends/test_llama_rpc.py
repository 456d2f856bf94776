"""A GGUF target split over this machine and 2 minions-rpc-servers on loopback (ggml's RPC
backend, backends/llama_remote.py), on the shipped SmolLM2 Q4_1 file: every row has the
bits of the same file on one machine, so greedy chat is identical and sampling follows the
target's law; a server down at start is named, and one killed mid-reply ends that reply
with a clean error, after which the next request reloads over the server left."""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest

from minions_local.core.errors import MinionsError
from tests.helpers.rpc_servers import free_port, require_rpc_backend, start_servers

pytestmark = [pytest.mark.gguf, pytest.mark.realmodel]

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed", allow_module_level=True)

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def model():
    from tests.models.conftest import require_wheel

    require_wheel()
    require_rpc_backend()
    from benchmarks.padded_gguf import source_gguf

    return str(source_gguf())


@pytest.fixture(scope="module")
def servers(model):
    running = start_servers(2)
    yield [s.endpoint for s in running]
    for s in running:
        s.kill()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIONS_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def alone(model):
    from minions_local import Engine

    return Engine.from_profile("cpu-demo", target=model, minions=[])


def test_rows_and_greedy_chat_over_two_servers_are_one_machines(model, servers, alone):
    from minions_local import Engine
    from minions_local.backends.llama_remote import RemoteLlamaTarget
    from minions_local.core.tree import TokenTree

    engine = Engine.from_profile("cpu-demo", target=model, minions=["ngram"], rpc=servers)
    target = engine.decoder.target
    assert isinstance(target, RemoteLlamaTarget)
    assert [place for place, _, _ in target.placement.runs()] == ["this machine", *servers]
    prompt = alone.prepare_chat(QUESTION).ids
    tree = TokenTree.from_root(prompt[-1])
    for token in (504, 260, 3575):  # a tree of 3 branches under the root, each a row of one pass
        tree.add(0, token)
    for t in (alone.decoder.target, target):
        t.reset()
    rows = [t.verify(prompt, tree).numpy() for t in (alone.decoder.target, target)]
    assert np.array_equal(rows[0], rows[1])
    for messages in (QUESTION, [{"role": "user", "content": "Write a Python function that adds two numbers."}]):
        engine.reset()
        alone.reset()
        got = engine.chat(messages, max_new_tokens=40)
        assert got.token_ids == alone.chat(messages, max_new_tokens=40).token_ids
    assert "Paris" in engine.chat(QUESTION, max_new_tokens=20).text
    trips, sent, received = target.network_counters()
    assert trips > 0 and sent > 0 and received > 0
    target.close()


def test_sampling_over_two_servers_follows_the_targets_law(model, servers, alone, monkeypatch):
    import minions_local.engine.reply as reply_module
    from minions_local import Engine
    from minions_local.core.sampling import SamplingParams
    from tests.helpers.stats import chi2_pvalue, first_two_tokens, two_token_law

    stream = iter(range(10**6))  # unseeded requests draw their drafts: made repeatable here
    monkeypatch.setattr(reply_module.random, "getrandbits", lambda bits: next(stream))
    # a fixed tree budget: the adaptive policy may decode without trees where a lone row is cheap
    engine = Engine.from_profile("cpu-demo", target=model, minions=[model], rpc=servers, budget=8, max_depth=4)
    prompt = engine.prepare_chat([{"role": "user", "content": "Name a colour."}]).ids
    sp = SamplingParams(1.0, 1.0, 3)
    expected = two_token_law(alone.decoder.target, prompt, sp)  # the law on one machine
    observed, drafted = first_two_tokens(engine, prompt, 200, temperature=1.0, top_k=3)
    assert drafted > 5  # some first steps took two tokens from one pass through the split
    assert chi2_pvalue(observed, expected, 200) > 1e-3
    engine.decoder.target.close()


def test_a_server_down_at_start_is_named(model, servers):
    from minions_local import Engine

    down = f"127.0.0.1:{free_port()}"
    with pytest.raises(MinionsError, match=f"Nothing listens at {down}.*minions-rpc-server"):
        Engine.from_profile("cpu-demo", target=model, minions=[], rpc=[servers[0], down])


def test_a_server_killed_mid_reply_ends_it_cleanly_and_the_next_request_reloads(model, alone):
    """Each a server of its own (killed here). The reply in flight ends with a clean error;
    the conversation's next request reloads over the server left, says so and how long it
    took, and replies as one machine does; with no server left it says why it cannot."""
    from minions_local import Engine
    from minions_local.backends.llama_rpc import RemoteError, RemoteLost
    from minions_local.core.events import NoticeEvent, TokenEvent

    own = start_servers(2)
    try:
        engine = Engine.from_profile("cpu-demo", target=model, minions=[], rpc=[s.endpoint for s in own])
        story = [{"role": "user", "content": "Write a long story about the sea."}]
        tokens = 0
        with pytest.raises(RemoteLost, match=f"The RPC server {own[1].endpoint} .*was lost during a pass: this "
                                             f"reply ends here. The conversation is kept"):
            for event in engine.stream_chat(story, max_new_tokens=60):
                tokens += isinstance(event, TokenEvent)
                if tokens == 3:
                    own[1].kill()
        assert tokens == 3
        events = list(engine.stream_chat(QUESTION, max_new_tokens=20))
        notices = [e.text for e in events if isinstance(e, NoticeEvent)]
        assert len(notices) == 1 and f"over this machine and {own[0].endpoint} in " in notices[0]
        assert f"after losing {own[1].endpoint} (still unreachable: {own[1].endpoint})" in notices[0]
        done = events[-1].generation
        alone.reset()
        assert done.token_ids == alone.chat(QUESTION, max_new_tokens=20).token_ids
        own[0].kill()
        with pytest.raises(RemoteLost):
            engine.chat(story, max_new_tokens=20)
        with pytest.raises(RemoteError, match="Cannot reload .*: no RPC server answers"):
            engine.chat(QUESTION, max_new_tokens=5)
        engine.reset()  # nothing left to free: still the same clean error
        with pytest.raises(RemoteError, match="no RPC server answers"):
            engine.chat(QUESTION, max_new_tokens=5)
    finally:
        for s in own:
            s.kill()


def test_a_server_lost_under_a_served_batch_fails_every_request_sharing_it(model, tmp_path):
    """Through minions-serve and the official client: two streamed chats share passes over
    a split; a server killed mid-reply ends both with a clean error (no traceback), the
    server goes on, and the next request loads the target again over the server left
    and says so in its reply's stats."""
    import threading

    import openai

    from tests.server.process import start_server

    own = start_servers(2)
    served = None
    try:
        served = start_server("--target", model, "--rpc", ",".join(s.endpoint for s in own), "--parallel", "2",
                              cwd=tmp_path, profile="cpu-demo", minions=["ngram"])
        client = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120)
        story = [{"role": "user", "content": "Write a long story about the sea."}]
        chunks, errors = [0, 0], [None, None]

        def read(i: int) -> None:
            try:
                for _ in client.chat.completions.create(model="m", messages=story, max_tokens=300, temperature=0,
                                                        stream=True):
                    chunks[i] += 1
            except openai.APIError as err:
                errors[i] = err

        readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
        for r in readers:
            r.start()
        deadline = time.monotonic() + 120
        while min(chunks) < 4 and time.monotonic() < deadline and all(r.is_alive() for r in readers):
            time.sleep(0.01)
        assert min(chunks) >= 4, f"both replies should be under way (chunks {chunks}):\n{served.log[-2000:]}"
        own[1].kill()
        for r in readers:
            r.join(120)
        for err in errors:
            assert err is not None and f"The RPC server {own[1].endpoint}" in str(err) and "lost" in str(err)
            assert "Traceback" not in str(err)
        reply = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8, temperature=0)
        notices = reply.model_extra["minions"].get("notices", [])
        assert reply.choices[0].message.content and len(notices) == 1, notices
        assert f"over this machine and {own[0].endpoint}" in notices[0] and f"after losing {own[1].endpoint}" in \
            notices[0]
        assert "Traceback" not in served.log
    finally:
        if served is not None:
            served.stop()
        for s in own:
            s.kill()


def test_plan_shows_the_split_and_each_round_trip(model, servers):
    import io

    from minions_local.tui.cli import main

    down = f"127.0.0.1:{free_port()}"
    out, err = io.StringIO(), io.StringIO()
    assert main(["--target", model, "--rpc", ",".join([*servers, down]), "--rpc-split", "1,1,1,1", "--plan"],
                stdout=out, stderr=err) == 0, err.getvalue()
    text = out.getvalue()
    assert "Split over 3 RPC servers" in text and f"{down}: not reachable now (Nothing listens" in text
    assert all(f"{s}: protocol 7.0.0" in text and "round trip" in text for s in servers)
    assert "layers (rpc_split): this machine: layers 0-7 + the output head" in text and f"{down}: layers 23-29 (" in text
    assert "network per pass: 3 round trips" in text and f"({down} not measured)" in text
    assert main(["--target", model, "--rpc", "localhost", "--plan"], stdout=out, stderr=err) == 1
    assert "--rpc: rpc server 'localhost' is not host:port" in err.getvalue()
