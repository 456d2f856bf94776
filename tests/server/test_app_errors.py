"""What a client gets when the model fails mid-reply: an error object (a 500, or an
error event once the stream has started), never a traceback; the server goes on."""

import http.client
import json
import threading
import time

import pytest
import uvicorn

from minions_local.core.errors import MinionsError
from minions_local.server.app import Settings, create_app
from minions_local.server.cli import _listen
from tests.helpers.fake_engine import FakeEngine


class FailingEngine(FakeEngine):
    def cancel(self) -> None:
        pass


@pytest.fixture
def serve():
    servers = []

    def start(engine):
        sock = _listen("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(create_app(engine, Settings(model_name="fake")), log_level="critical"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        servers.append((server, thread))
        return sock.getsockname()[1]

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


def post(port, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read().decode()


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}


@pytest.mark.parametrize("failure, status, code", [
    (MinionsError("The target produced NaN logits; check the weights."), 500, "model_error"),
    (RuntimeError("shape mismatch [1, 2] vs [3]"), 500, "internal_error"),
])
def test_a_failure_mid_reply_is_an_error_object(serve, failure, status, code):
    port = serve(FailingEngine(fail_after=2, fail_with=failure))
    got, text = post(port, "/v1/chat/completions", CHAT)
    error = json.loads(text)["error"]
    assert got == status and error["code"] == code and error["type"] == "server_error"
    assert "Traceback" not in text and ("NaN logits" in error["message"]) == (code == "model_error")

    got, text = post(port, "/v1/chat/completions", {**CHAT, "stream": True})
    assert got == 200
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[1])["choices"][0]["delta"]["content"]  # text came before the failure
    assert json.loads(events[-1])["error"]["code"] == code and "[DONE]" not in events
    assert "Traceback" not in text


def test_the_server_goes_on_after_a_failure(serve):
    engine = FailingEngine(fail_after=1)
    port = serve(engine)
    assert post(port, "/v1/completions", {"prompt": "x", "max_tokens": 5})[0] == 500
    engine.fail_after = None
    status, text = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 5})
    reply = json.loads(text)
    assert status == 200 and reply["choices"][0]["text"] and reply["usage"]["prompt_tokens"] == 12
    assert "notices" not in reply["minions"]
    # A reload before a request (the engine lost an RPC server) is stated in its reply,
    # streamed or not, and only in that one.
    reload = "The target loaded again over this machine and b:2 in 3.1 s, after losing a:1."
    for stream in (False, True):
        engine.notices = [reload]
        status, text = post(port, "/v1/chat/completions", {**CHAT, "stream": stream})
        if stream:
            last = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")][-1]
            assert last["minions"]["notices"] == [reload]
        else:
            assert status == 200 and json.loads(text)["minions"]["notices"] == [reload]
    assert "notices" not in json.loads(post(port, "/v1/chat/completions", CHAT)[1])["minions"]
