"""`minions-serve` as a client sees it: the official `openai` client (and raw HTTP for
what a client library would not send) against a real server process on 127.0.0.1."""

import concurrent.futures
import http.client
import json
import signal
import time

import openai
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.process import start_server

KEY = "test-key-123"
QUEUE = 3
BODY_LIMIT = 64 * 1024
HELLO = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-cwd")


@pytest.fixture(scope="module")
def server(workdir):
    server = start_server("--api-key", KEY, "--queue", str(QUEUE), "--max-body-bytes", str(BODY_LIMIT),
                          cwd=workdir)
    yield server
    server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def raw(server, method, path, body=None, *, key=KEY, headers=None, timeout=60):
    """(status, parsed JSON or text) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    sent = dict(headers or {})
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
        sent.setdefault("Content-Type", "application/json")
    conn.request(method, "/v1" + path, body=body, headers=sent)
    response = conn.getresponse()
    data = response.read().decode("utf-8", "replace")
    conn.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data


def assert_api_error(status, body, expected_status, param=None):
    assert status == expected_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body


# --- the API ----------------------------------------------------------------------------


def test_loading_reported_progress(server):
    loaded = [line for line in server.lines if line.startswith("loaded ")]
    assert loaded[0].startswith("loaded target → ") and any("qwen2-xs" in line for line in loaded[1:]), loaded


def test_models_lists_the_one_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["stdlib-demo"]
    assert client.models.retrieve("stdlib-demo").id == "stdlib-demo"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_completion(client, model):
    reply = client.chat.completions.create(model=model, messages=HELLO, max_tokens=16, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and reply.model == model
    assert reply.usage.completion_tokens >= 1 and reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    stats = reply.model_extra["minions"]
    assert stats["target_passes"] >= 1 and stats["tokens_per_pass"] >= 1 and stats["profile"] == "stdlib-demo"
    again = client.chat.completions.create(model="any-name", messages=HELLO, max_tokens=16, temperature=0)
    assert again.choices[0].message.content == choice.message.content


def test_chat_stream_matches_the_whole_reply(client, model):
    whole = client.chat.completions.create(model=model, messages=HELLO, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=HELLO, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_completion_and_its_stream(client, model):
    whole = client.completions.create(model=model, prompt="def fib(n):", max_tokens=20, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.completions.create(model=model, prompt="def fib(n):", max_tokens=20, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].model_extra["minions"]["target_passes"] >= 1
    ids = client.completions.create(model=model, prompt=[0, 5, 6, 7], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_stop_and_seed(client, model):
    whole = client.completions.create(model=model, prompt="def fib(n):", max_tokens=20, temperature=0).choices[0]
    stop = whole.text.strip()[:2]
    cut = client.completions.create(model=model, prompt="def fib(n):", max_tokens=20, temperature=0,
                                    stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and whole.text.startswith(cut.text)
    seeded = [client.completions.create(model=model, prompt="def", max_tokens=12, temperature=0.9, top_p=0.95,
                                        seed=1234).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


# --- refusals ---------------------------------------------------------------------------

CHAT = {"messages": HELLO, "max_tokens": 4}
BAD_CHAT = [
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({**CHAT, "tool_choice": "auto"}, "tool_choice"),
    ({**CHAT, "logprobs": True}, "logprobs"),
    ({**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ({**CHAT, "presence_penalty": 0.5}, "presence_penalty"),
    ({**CHAT, "temperature": 2.5}, "temperature"),
    ({**CHAT, "temperature": "0.5"}, "temperature"),
    ({**CHAT, "temperature": 1e-9}, "temperature"),  # the API allows it; the engine names its range
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": True}, "max_tokens"),
    ({**CHAT, "max_tokens": 2.5}, "max_tokens"),
    ({**CHAT, "max_tokens": 10**6}, "messages"),  # context_length_exceeded
    ({**CHAT, "seed": -1}, "seed"),
    ({**CHAT, "seed": 2**70}, "seed"),
    ({**CHAT, "stop": [None]}, "stop"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": "hello"}, "messages"),
    ({"max_tokens": 4}, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({**CHAT, "messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages.0"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
    ({**CHAT, "messages": [{"role": "user", "content": "\udcff"}]}, "messages"),
    ({**CHAT, "messages": [{"role": "user"}]}, "messages.0.content"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body, param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_requests_get_400_naming_the_field(server, body, param, stream):
    status, reply = raw(server, "POST", "/chat/completions", {**body, "stream": stream} if "stream" not in body
                        else body)
    assert_api_error(status, reply, 400, param)


BAD_COMPLETIONS = [
    ({"prompt": ["a", "b"], "max_tokens": 4}, "prompt"),
    ({"prompt": [1, "a"], "max_tokens": 4}, "prompt"),
    ({"prompt": [0, 10**6], "max_tokens": 4}, "prompt"),
    ({"prompt": 5, "max_tokens": 4}, "prompt"),
    ({"prompt": "x", "max_tokens": 4, "echo": True}, "echo"),
    ({"prompt": "x", "max_tokens": 4, "best_of": 3}, "best_of"),
    ({"prompt": "x", "max_tokens": 4, "suffix": "y"}, "suffix"),
    ({"prompt": "x", "max_tokens": 4, "logprobs": 2}, "logprobs"),
]


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completion_requests_get_400(server, body, param):
    assert_api_error(*raw(server, "POST", "/completions", body), 400, param)


@pytest.mark.parametrize("body", [b"{", b"[1, 2]", b'{"prompt": NaN}', b'{"max_tokens": Infinity}',
                                  b'{"prompt": "\xff\xfe"}', b"[" * 50_000, b""])
def test_bodies_that_are_not_json_objects_get_400(server, body):
    assert_api_error(*raw(server, "POST", "/completions", body), 400)


def test_size_limit_method_and_path(server):
    huge = json.dumps({"prompt": "x" * BODY_LIMIT, "max_tokens": 1}).encode()
    assert_api_error(*raw(server, "POST", "/completions", huge), 413)
    # Without a Content-Length (chunked), the limit is counted as the body arrives.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=iter([huge[i:i + 8192] for i in range(0, len(huge), 8192)]),
                 headers={"Authorization": f"Bearer {KEY}"}, encode_chunked=True)
    response = conn.getresponse()
    assert_api_error(response.status, json.loads(response.read()), 413)
    conn.close()
    assert_api_error(*raw(server, "GET", "/completions"), 405)
    assert_api_error(*raw(server, "POST", "/engines/x/completions", {}), 404)


def test_the_client_raises_its_own_errors(client, model):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=HELLO, n=3)
    assert err.value.body["param"] == "n" and "not supported" in err.value.body["message"]


def test_api_key_is_required(server):
    for key in (None, "wrong", KEY + "x", ""):
        assert_api_error(*raw(server, "GET", "/models", key=key), 401)
        assert_api_error(*raw(server, "POST", "/chat/completions", CHAT, key=key), 401)
    assert_api_error(*raw(server, "GET", "/models", key=None, headers={"Authorization": f"Basic {KEY}"}), 401)
    wrong = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


# --- load, soak, cancellation -----------------------------------------------------------


def test_sixteen_concurrent_requests_all_answered_or_429(server, client, model):
    prompts = [f"def f{i}(" for i in range(16)]
    reference = {p: client.completions.create(model=model, prompt=p, max_tokens=24, temperature=0).choices[0].text
                 for p in prompts}

    def ask(prompt):
        try:
            if prompt.endswith(("1(", "3(", "5(", "7(")):
                text = "".join(c.choices[0].text for c in client.completions.create(
                    model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True))
            else:
                text = client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                                 temperature=0).choices[0].text
            return prompt, text
        except openai.RateLimitError as err:
            assert err.status_code == 429 and err.response.headers["retry-after"]
            return prompt, 429

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, prompts))
    assert len(answers) == 16
    served = [(p, text) for p, text in answers if text != 429]
    assert len(served) >= 1 + QUEUE or len(served) == 16
    for prompt, text in served:
        assert text == reference[prompt]


def test_soak_keeps_memory_flat(server, client, model):
    process = psutil.Process(server.proc.pid)

    def burst(n):
        for i in range(n):
            if i % 2:
                client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"hi {i}"}],
                                               max_tokens=2, temperature=0)
            else:
                client.completions.create(model=model, prompt=f"x = {i}", max_tokens=2, temperature=0.7)

    burst(60)  # warm up: allocator pools, caches of every shape
    before = process.memory_info().rss
    burst(300)
    grown = process.memory_info().rss - before
    assert grown < 24 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 300 requests"


LONG = {"prompt": "hello", "max_tokens": 1200, "temperature": 0}


@pytest.fixture(scope="module")
def full(client, model):
    """The speculation stats of the long request run to its end."""
    whole = client.completions.create(model=model, **LONG)
    assert whole.choices[0].finish_reason == "length", "the long request must not stop early"
    return whole.model_extra["minions"]


def test_disconnected_stream_cancels_its_generation(server, client, model, full):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({**LONG, "stream": True}),
                 {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    mark = len(server.lines)
    assert response.readline().startswith(b"data: ")
    conn.sock.shutdown(2)
    conn.close()
    passes = int(server.wait_for(r"cancelled after (\d+) target passes", start=mark).group(1))
    assert passes < full["target_passes"] / 2
    quick = client.completions.create(model=model, prompt="x", max_tokens=2)
    assert quick.model_extra["minions"]["queue_seconds"] < full["decode_seconds"] / 2


def test_disconnected_plain_request_cancels_its_generation(server, client, model, full):
    mark = len(server.lines)
    impatient = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0,
                              timeout=full["decode_seconds"] / 8)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=model, **LONG)
    passes = int(server.wait_for(r"cancelled after (\d+) target passes", start=mark).group(1))
    assert passes < full["target_passes"] / 2


junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
text = st.one_of(st.text(max_size=24), st.binary(max_size=24).map(lambda b: b.decode("utf-8", "surrogateescape")))
small_count = st.one_of(st.integers(1, 6), st.integers(-3, 0), st.just(10**9), st.floats(1, 6), st.text(max_size=2),
                        st.booleans())
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), junk),
     "content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2),
                          junk)},
    optional={"name": junk, "tool_calls": junk})
options = {
    "temperature": st.one_of(st.floats(0, 2), junk), "top_p": st.one_of(st.floats(0, 1), junk),
    "seed": st.one_of(st.integers(0, 2**64), junk), "stop": st.one_of(text, st.lists(text, max_size=5), junk),
    "stream": st.one_of(st.booleans(), junk), "stream_options": st.one_of(st.just({"include_usage": True}), junk),
    "n": st.one_of(st.integers(0, 3), junk), "model": st.one_of(text, junk), "tools": junk, "logit_bias": junk,
    "presence_penalty": st.one_of(st.floats(-3, 3), junk), "user": junk,
}
chat_bodies = st.fixed_dictionaries({"messages": st.one_of(st.lists(message, max_size=3), junk),
                                     "max_tokens": small_count}, optional=options)
completion_bodies = st.fixed_dictionaries(
    {"prompt": st.one_of(text, st.lists(st.integers(-2, 5000), max_size=6), st.lists(text, max_size=2), junk),
     "max_tokens": small_count}, optional={**options, "echo": junk, "suffix": junk, "best_of": junk})


def _encode(body, raw_surrogates):
    """JSON as a careful client writes it (surrogates escaped) or as bytes that are not UTF-8."""
    if raw_surrogates:
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogateescape")
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def reference_reply(client, model):
    return client.chat.completions.create(model=model, messages=HELLO, max_tokens=16, temperature=0)


def _only_200_or_4xx(server, client, model, reference_reply, path, body, raw_surrogates):
    status, reply = raw(server, "POST", path, _encode(body, raw_surrogates))
    assert status == 200 or 400 <= status < 500, (status, reply)
    if status != 200:
        assert_api_error(status, reply, status)
    again = client.chat.completions.create(model=model, messages=HELLO, max_tokens=16, temperature=0)
    assert again.choices[0].message.content == reference_reply.choices[0].message.content


FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(body=chat_bodies, raw_surrogates=st.booleans())
def test_random_chat_requests_get_200_or_4xx(server, client, model, reference_reply, body, raw_surrogates):
    _only_200_or_4xx(server, client, model, reference_reply, "/chat/completions", body, raw_surrogates)


@FUZZ
@given(body=completion_bodies, raw_surrogates=st.booleans())
def test_random_completion_requests_get_200_or_4xx(server, client, model, reference_reply, body, raw_surrogates):
    _only_200_or_4xx(server, client, model, reference_reply, "/completions", body, raw_surrogates)


def test_the_server_wrote_no_files(workdir):
    """The server's working folder stays empty: it writes nothing anywhere we can see."""
    assert list(workdir.iterdir()) == []


def test_sigterm_stops_cleanly_with_work_in_flight(server, client, model):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({**LONG, "stream": True}),
                 {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Decoding beside the first (continuous batching) or waiting, it must get a 503. Greedy
        # and long, as the first: a sampled reply could end on its own before the signal.
        waiting = pool.submit(raw, server, "POST", "/completions", dict(LONG))
        time.sleep(0.3)
        t0 = time.monotonic()
        assert server.stop(signal.SIGTERM) == 0
        assert time.monotonic() - t0 < 10
        status, body = waiting.result(10)
    assert_api_error(status, body, 503)
    rest = response.read().decode()
    assert "server_shutting_down" in rest and "[DONE]" not in rest
    assert "Traceback" not in server.log and "minions-serve: stopped" in server.log
