"""An oversized request gets its 413 and JSON error in every client, against a real
`minions-serve` process. urllib is the one that saw a reset: it sends the whole body
before reading the answer and asks for `Connection: close`, so a server that answers
and closes with the body unread makes the kernel reset the connection under it."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import urllib.error
import urllib.request

import openai
import pytest
import requests

from tests.server.process import start_server

KEY = "body-limit-key"
BODY_LIMIT = 64 * 1024
HUGE = 12_000_000
"""The issue's 12 MB request: far more than the socket buffers hold, so a client that
sends it all first is still sending when the server answers."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server("--api-key", KEY, "--max-body-bytes", str(BODY_LIMIT),
                          cwd=tmp_path_factory.mktemp("serve-cwd"))
    yield server
    server.stop(signal.SIGKILL)


def huge_chat() -> dict:
    return {"model": "any", "messages": [{"role": "user", "content": "x" * HUGE}], "max_tokens": 1}


def assert_413(status: int, body: dict) -> None:
    assert status == 413, body
    assert set(body) == {"error"} and body["error"]["code"] == "request_too_large", body
    assert str(BODY_LIMIT) in body["error"]["message"]


def with_urllib(server) -> tuple[int, dict]:
    request = urllib.request.Request(f"{server.base_url}/chat/completions", data=json.dumps(huge_chat()).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    return err.value.code, json.loads(err.value.read())


def with_requests(server) -> tuple[int, dict]:
    response = requests.post(f"{server.base_url}/chat/completions", json=huge_chat(), timeout=60,
                             headers={"Authorization": f"Bearer {KEY}"})
    return response.status_code, response.json()


def with_openai(server) -> tuple[int, dict]:
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)
    chat = huge_chat()
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=chat["model"], messages=chat["messages"], max_tokens=1)
    return err.value.status_code, err.value.response.json()


@pytest.mark.parametrize("send", [with_urllib, with_requests, with_openai], ids=["urllib", "requests", "openai"])
def test_every_client_reads_the_413_of_a_12_mb_request(server, send):
    assert_413(*send(server))


def test_the_connection_stays_usable_after_a_refused_body(server):
    """The drained body leaves a keep-alive connection ready for its next request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(huge_chat()).encode(), headers=headers)
    response = conn.getresponse()
    assert_413(response.status, json.loads(response.read()))
    assert response.getheader("connection") != "close"
    sock = conn.sock
    conn.request("GET", "/v1/models", headers=headers)
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read())["data"]
    assert conn.sock is sock  # http.client reconnects silently: this says it did not need to
    conn.close()


def head_only(server, length: int, *extra: str) -> bytes:
    """Send a request's headers declaring `length` body bytes and none of the body;
    return what the server answers (it must answer without the body)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        lines = ["POST /v1/chat/completions HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {KEY}",
                 "Content-Type: application/json", f"Content-Length: {length}", *extra]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer


def test_a_client_waiting_for_100_continue_is_refused_before_it_sends(server):
    """curl's way with large bodies: the 413 comes instead of '100 Continue'."""
    answer = head_only(server, HUGE, "Expect: 100-continue")
    assert answer.startswith(b"HTTP/1.1 413") and b"100 Continue" not in answer
    assert_413(413, json.loads(answer.split(b"\r\n\r\n", 1)[1]))


def test_a_body_too_large_to_drain_is_refused_from_its_content_length(server):
    answer = head_only(server, 10**10)
    assert answer.startswith(b"HTTP/1.1 413")
    assert_413(413, json.loads(answer.split(b"\r\n\r\n", 1)[1]))
