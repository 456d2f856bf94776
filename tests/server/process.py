"""A real `minions-serve` process on 127.0.0.1 for the server tests.

It is started the way a user starts it (`python -m minions_local.server`), on a port
it picks itself (--port 0, read back from its "ready on" line), with the fast
stdlib-trained demo family, so that a whole test module needs one load of a few
seconds. Its stderr is collected line by line for the tests to read.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PROFILE = "stdlib-demo"
"""The fast test family's profile (the shipped demo target and minions)."""
MINIONS = ["demo:minion-qwen2-xs", "ngram"]
READY = re.compile(r"ready on http://127\.0\.0\.1:(\d+)/v1")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int = 0
    lines: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 10.0, start: int = 0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines[start:]:
                found = re.search(pattern, line)
                if found:
                    return found
            time.sleep(0.02)
        raise AssertionError(f"no {pattern!r} in the server log within {timeout} s:\n{self.log[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def start_server(*args: str, cwd: Path, timeout: float = 120.0, profile: str = PROFILE,
                 minions: Sequence[str] = MINIONS, one_thread: bool = True) -> ServerProcess:
    """minions: --minion flags (empty: the profile's own). one_thread: OMP_NUM_THREADS=1
    (the test family is small; a real model's reference runs on every core, as users do)."""
    command = [sys.executable, "-m", "minions_local.server", "--profile", profile, "--port", "0"]
    for minion in minions:
        command += ["--minion", minion]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"} | ({"OMP_NUM_THREADS": "1"} if one_thread else {})
    env.pop("MINIONS_API_KEY", None)
    proc = subprocess.Popen([*command, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
    server = ServerProcess(proc)
    assert proc.stderr is not None
    stderr = proc.stderr

    def read() -> None:
        for line in stderr:
            server.lines.append(line)

    threading.Thread(target=read, name="server-stderr", daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = next((READY.search(line) for line in server.lines if READY.search(line)), None)
        if found:
            server.port = int(found.group(1))
            return server
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    server.stop(signal.SIGKILL)
    raise AssertionError(f"minions-serve did not get ready:\n{server.log[-3000:]}")
