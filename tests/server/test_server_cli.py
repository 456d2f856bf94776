"""`minions-serve` from the command line: the open default, Ctrl+C, and start-up errors."""

import http.client
import json
import signal
import subprocess
import sys
import time

import openai

from tests.server.process import start_server


def test_default_server_is_open_on_loopback_and_ctrl_c_stops_it(tmp_path):
    server = start_server(cwd=tmp_path)
    try:
        assert "no API key" in server.log
        client = openai.OpenAI(base_url=server.base_url, api_key="anything", max_retries=0, timeout=30)
        reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens >= 1
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", "/v1/chat/completions",
                     json.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1500,
                                 "temperature": 0, "stream": True}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.readline().startswith(b"data: ")
        t0 = time.monotonic()
        assert server.stop(signal.SIGINT) == 0
        assert time.monotonic() - t0 < 10
        assert "server_shutting_down" in response.read().decode()
        assert "Traceback" not in server.log and "minions-serve: stopped" in server.log
    finally:
        server.stop(signal.SIGKILL)


def _serve(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "minions_local.server", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_port_in_use_fails_before_loading(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        done = _serve("--port", str(port))
    assert done.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr and "loaded" not in done.stderr
    assert time.monotonic() - t0 < 20


def test_bad_profile_and_arguments_are_reported_without_traceback():
    done = _serve("--profile", "no-such-profile", "--port", "0")
    assert done.returncode == 1 and "no-such-profile" in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.startswith("minions-serve: ") and done.stderr.endswith("\n")
    for args in (["--port", "-1"], ["--queue", "x"], ["--max-body-bytes", "10"]):
        done = _serve(*args)
        assert done.returncode == 2 and "Traceback" not in done.stderr
