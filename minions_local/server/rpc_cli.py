"""`minions-rpc-server`: lend this machine's memory and cores to a target split over
several machines (`minions-chat --rpc HOST:PORT,...`).

It is ggml's own RPC server (ggml_backend_rpc_start_server in libggml-rpc, the library
the client uses; backends/llama_rpc.py), started with what keeps replies exact: the same
matmul kernel at every row count (GGML_CPU_TILED_MM, set before ggml's first matmul, as
the client sets it for itself). The client's load check (llama_load.rows_differ) runs
through the split, so a server started otherwise is found out before any reply.

The protocol has no authentication: whoever reaches the port can allocate memory and run
computations on this machine. So it listens on loopback unless told a host, and refuses
every interface (0.0.0.0) without --allow-network.

A client that vanishes without closing its connection (its machine lost power, the link
went down) would hold ggml's server, which serves one client at a time and waits on the
socket without a timeout, for good: no client could connect again. So the listening
socket gets TCP keepalive (and a user timeout), which every connection it accepts
inherits: a silent peer is probed after KEEPALIVE_IDLE_S and dropped within about a
minute more, and ggml's loop goes back to accepting. A client that is idle but alive
answers the probes from its kernel, so an idle chat keeps its server.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from minions_local.core.errors import MinionsError

KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 3
"""A connection silent this long is probed, every interval, and dropped after that many
unanswered probes (about 60 s in all)."""
USER_TIMEOUT_MS = 60_000
"""Data sent to a peer that acknowledges nothing for this long drops the connection too
(keepalive only probes connections with nothing in flight)."""
NO_AUTH = "the RPC protocol has no authentication: anyone who can reach this port can use this machine's memory and cores"
WILDCARDS = {"0.0.0.0", "", "::", "*"}


def default_cache_dir() -> Path:
    """Where rpc-server -c keeps tensors ($LLAMA_CACHE, else the user cache's llama.cpp/rpc)."""
    root = os.environ.get("LLAMA_CACHE")
    if root:
        return Path(root) / "rpc"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama.cpp" / "rpc"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minions-rpc-server", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", "-p", type=int, default=50052, help="port to listen on (default: 50052)")
    p.add_argument("--threads", "-t", type=int, default=os.cpu_count() or 1,
                   help="CPU threads for the layers it computes (default: every core)")
    p.add_argument("--cache", metavar="DIR", default=str(default_cache_dir()),
                   help="keep the tensors it receives here, so that a reload of the same model reads them from "
                        "this disk instead of the network (default: %(default)s)")
    p.add_argument("--no-cache", action="store_true", help="keep no tensors on disk")
    p.add_argument("--allow-network", action="store_true",
                   help="allow listening on every interface (0.0.0.0): " + NO_AUTH)
    p.add_argument("--version", action="store_true", help="print the versions and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return serve(args)
    except MinionsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def serve(args: argparse.Namespace) -> int:
    from minions_local.backends import llama_rpc

    if args.version:
        import llama_cpp

        print(f"minions-rpc-server: llama-cpp-python {llama_cpp.__version__}, RPC protocol "
              f"{llama_rpc.version_text(llama_rpc.protocol())}")
        return 0
    host = args.host.strip()
    if host in WILDCARDS and not args.allow_network:
        print(f"error: refusing to listen on {host or 'every interface'} without --allow-network: {NO_AUTH}.",
              file=sys.stderr)
        return 2
    if ":" in host:
        print("error: IPv6 addresses cannot be served: ggml's client splits an endpoint at its first ':'.",
              file=sys.stderr)
        return 2
    if not llama_rpc.is_loopback(host):
        print(f"warning: listening on {host}: {NO_AUTH}; use it on a network you trust.", file=sys.stderr)
    if args.threads < 1 or not 0 < args.port < 65536:
        print("error: --threads must be at least 1 and --port lie in 1..65535.", file=sys.stderr)
        return 2
    problem = _cannot_listen(host, args.port)
    if problem:
        print(f"error: cannot listen on {host}:{args.port}: {problem}.", file=sys.stderr)
        return 1
    cache = None
    if not args.no_cache:
        cache = Path(args.cache).expanduser()
        cache.mkdir(parents=True, exist_ok=True)
    llama_rpc.protocol()  # an unknown llama-cpp-python is refused before anything listens
    devices = llama_rpc.local_compute_devices()  # loads llama.cpp: the kernel switches are set first
    print(f"minions-rpc-server on {host}:{args.port}: {', '.join(llama_rpc.device_names(devices))}, "
          f"{args.threads} threads, tensor cache {cache or 'off'}", flush=True)
    # ggml's server loop never returns while it listens, and a C call does not see Python's
    # signals: it runs on a thread of its own, and this one waits for SIGINT / SIGTERM.
    stopped = threading.Event()
    ended = threading.Thread(target=lambda: (llama_rpc.start_server(f"{host}:{args.port}", str(cache) if cache
                                                                     else None, args.threads, devices),
                                             stopped.set()), daemon=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    ended.start()
    if not _arm_keepalive(args.port, ended):
        print("warning: could not find the server's listening socket to set TCP keepalive on: a client that "
              "vanishes without closing its connection will hold this server until it is restarted.",
              file=sys.stderr)
    while not stopped.wait(0.5):
        pass
    sys.stdout.flush()
    if ended.is_alive():
        os._exit(0)  # the server thread sits in C: leave without waiting for it
    print(f"error: the server stopped: cannot listen on {host}:{args.port}?", file=sys.stderr)
    return 1


def _arm_keepalive(port: int, server: threading.Thread, wait_s: float = 10.0) -> bool:
    """Set TCP keepalive on the socket ggml's server (in this process) listens on at `port`,
    found among this process's file descriptors once it listens; False if it is not found
    within `wait_s` (the server thread ended, say)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and server.is_alive():
        for name in os.listdir("/proc/self/fd"):
            try:
                if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    continue
                sock = socket.socket(fileno=os.dup(int(name)))  # the same socket, through a second descriptor
            except OSError:
                continue
            with sock:
                try:
                    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    if not listening or sock.family != socket.AF_INET or sock.getsockname()[1] != port:
                        continue
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
                    return True  # (closing the second descriptor leaves the server's own open)
                except OSError:
                    continue
        time.sleep(0.01)
    return False


def _cannot_listen(host: str, port: int) -> str:
    """Why binding would fail ('' when it would not): said here, as ggml only prints 'Failed'."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            return err.strerror or str(err)
    return ""


if __name__ == "__main__":
    sys.exit(main())
