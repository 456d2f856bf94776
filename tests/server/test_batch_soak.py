"""A soak against a real `minions-serve` process decoding up to 16 requests together:
64 requests from the official openai client, a quarter of them cancelled mid-reply,
bad requests mixed in. Every finished greedy reply equals the same request served
alone, streamed or not (no token lost or duplicated), no 5xx, and memory stays flat
when the same soak runs again."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import urllib.error
import urllib.request

import openai
import psutil
import pytest

from tests.server.process import start_server

PARALLEL = 16
PROMPTS = [f"def step_{i}(state, action):" for i in range(16)]
BAD = [
    {"prompt": "x", "max_tokens": 4, "temperature": -1},  # out of range
    {"prompt": "x", "max_tokens": 4, "n": 2},  # refused, not ignored
    {"prompt": "x", "max_tokens": 10**7},  # past the context window
    {"prompt": [10**9], "max_tokens": 4},  # a token id the model does not have
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server("--parallel", str(PARALLEL), "--queue", "64", cwd=tmp_path_factory.mktemp("soak"))
    yield server
    server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def _complete(client, prompt: str, tokens: int) -> tuple[str, int]:
    reply = client.completions.create(model="m", prompt=prompt, max_tokens=tokens, temperature=0)
    return reply.choices[0].text, reply.usage.completion_tokens


def _streamed(client, prompt: str, tokens: int, cancel_after: int | None) -> str | None:
    """The streamed text; None when the client went away after `cancel_after` chunks."""
    stream = client.completions.create(model="m", prompt=prompt, max_tokens=tokens, temperature=0, stream=True)
    parts = []
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
        if cancel_after is not None and len(parts) >= cancel_after:
            stream.close()  # the client goes away mid-reply
            return None
    return "".join(parts)


def _bad(server, body: dict) -> int:
    request = urllib.request.Request(f"{server.base_url}/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def _soak(server, client, reference: dict[str, tuple[str, int]]) -> list:
    def one(i: int):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 8 == 6:
            return "bad", _bad(server, BAD[(i // 8) % len(BAD)])
        if i % 4 == 1:  # a quarter: streamed, and the client goes away after a few chunks
            return "cancelled", _streamed(client, prompt, 40, cancel_after=2 + i % 3)
        if i % 4 == 3:
            return "streamed", prompt, _streamed(client, prompt, 40, None)
        return "complete", prompt, _complete(client, prompt, 40)

    with concurrent.futures.ThreadPoolExecutor(24) as pool:  # more clients than slots: some wait
        return list(pool.map(one, range(64)))


def test_soak_of_batched_requests(server, client):
    process = psutil.Process(server.proc.pid)
    reference = {p: _complete(client, p, 40) for p in PROMPTS}  # one at a time
    for round_ in range(2):  # the second round must not grow memory: every slot is warm after the first
        if round_ == 1:
            before = process.memory_info().rss
        outcomes = _soak(server, client, reference)
        kinds = [o[0] for o in outcomes]
        assert kinds.count("cancelled") == 16 and kinds.count("bad") == 8
        for outcome in outcomes:
            if outcome[0] == "bad":
                assert 400 <= outcome[1] < 500, outcome
            elif outcome[0] == "cancelled":
                assert outcome[1] is None
            elif outcome[0] == "streamed":
                assert outcome[2] == reference[outcome[1]][0]  # every token once, in order
            else:
                assert outcome[2] == reference[outcome[1]]  # text and token count
    grown = process.memory_info().rss - before
    assert grown < 48 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over a second soak of 64 requests"
    assert " 500 " not in server.log and "Traceback" not in server.log
    passes = [int(m) for m in _batch_sizes(server.log)]
    assert passes and max(passes) > 1, "no request shared a pass"


def _batch_sizes(log: str) -> list[str]:
    import re

    return re.findall(r"\(up to (\d+)\)", log)
