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
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from minions_local.core.errors import MinionsError

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
    while not stopped.wait(0.5):
        pass
    sys.stdout.flush()
    if ended.is_alive():
        os._exit(0)  # the server thread sits in C: leave without waiting for it
    print(f"error: the server stopped: cannot listen on {host}:{args.port}?", file=sys.stderr)
    return 1


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
