"""`minions-rpc-server`s on loopback for the split-target tests: each a process of its own
on a free port, waited for until it answers the handshake, killed at the end."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def require_rpc_backend() -> None:
    """Skip where llama-cpp-python was built without ggml's RPC backend; CI
    (MINIONS_REQUIRE_REALMODEL) builds it (scripts/build_llama_cpp_wheel.sh), so there it fails."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.origin and (Path(spec.origin).parent / "lib" / "libggml-rpc.so").exists():
        return
    why = "llama-cpp-python lacks ggml's RPC backend (bash scripts/build_llama_cpp_wheel.sh builds it in)"
    if os.environ.get("MINIONS_REQUIRE_REALMODEL"):
        pytest.fail(why)
    pytest.skip(why)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One minions-rpc-server process on 127.0.0.1."""

    def __init__(self, cache: Path | None = None) -> None:
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "minions_local.server.rpc_cli", "--port", str(self.port), "--threads", "1"]
        args += ["--cache", str(cache)] if cache is not None else ["--no-cache"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)

    def wait_ready(self, timeout: float = 60.0) -> None:
        from minions_local.backends.llama_rpc import RemoteError, handshake

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"minions-rpc-server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                handshake(self.endpoint, 2.0, probes=1)
                return
            except RemoteError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _die_with_parent() -> None:
    """A test process that crashes leaves no server behind (Linux: PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def start_servers(n: int, cache: Path | None = None) -> list[Server]:
    servers = [Server(cache / str(i) if cache else None) for i in range(n)]
    try:
        for s in servers:
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.kill()
        raise
    return servers
