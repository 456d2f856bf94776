"""`minions-serve`: load the engine once (with a progress bar), then serve the OpenAI
API on /v1 until SIGINT or SIGTERM.

The port is bound before the weights load, so a port in use fails at once; SIGINT or
SIGTERM stop taking requests, cancel the running generation after its pass, answer
the queued ones 503 and exit 0.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any, TextIO

from minions_local.core.errors import MinionsError
from minions_local.core.events import LoadProgress
from minions_local.profile.split import add_rpc_arguments, rpc_overrides
from minions_local.server.app import DEFAULT_MAX_BODY_BYTES, Settings, create_app

DEFAULT_PROFILE = "cpu-demo"
API_KEY_ENV = "MINIONS_API_KEY"

DESCRIPTION = f"""\
Serve a big local model, sped up by its minions (lossless speculative decoding), over
the OpenAI API: GET /v1/models, POST /v1/chat/completions and POST /v1/completions,
streamed or not. Point any OpenAI client at http://HOST:PORT/v1. Only loopback is
served unless --host says otherwise; set an API key with --api-key or ${API_KEY_ENV}."""


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minions-serve", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_argument_group("model")
    model.add_argument("--profile", "-p", default=DEFAULT_PROFILE, metavar="NAME|PATH",
                       help=f"hardware + model profile: a shipped name or a .toml path (default: {DEFAULT_PROFILE})")
    model.add_argument("--target", metavar="PATH", help="use this target checkpoint instead of the profile's")
    model.add_argument("--minion", metavar="PATH", action="append", dest="minions",
                       help="use this minion instead of the profile's (repeat for several; 'ngram' for n-gram)")
    add_rpc_arguments(model)
    model.add_argument("--model-name", metavar="NAME",
                       help="the model id clients see (default: the profile's name)")
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, loopback only)")
    net.add_argument("--port", type=_count(0), default=8000, help="port (default: 8000; 0 picks a free one)")
    net.add_argument("--api-key", metavar="KEY",
                     help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set, else none)")
    net.add_argument("--parallel", type=_count(1), metavar="N",
                     help="requests decoding at once, sharing every target pass (default: what memory allows for "
                          "their caches, at most 8 on a CPU)")
    net.add_argument("--queue", type=_count(0), default=8, metavar="N",
                     help="requests that may wait while --parallel decode; more get 429 (default: 8)")
    net.add_argument("--max-body-bytes", type=_count(1024), default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                     help=f"largest request body; larger gets 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                     help="server log on stderr (default: info, one line per request)")
    return p


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound before the weights load so that a port in use fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio turns Nagle off only on sockets that say they
    # are TCP; with it on, each response waits out the client's delayed ACK (44 ms a
    # request instead of 0.1 ms on loopback).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ProgressBar:
    """Loading progress on stderr: a redrawn bar on a terminal, a line per part otherwise."""

    def __init__(self, err: TextIO) -> None:
        self.err = err
        self.live = err.isatty()
        self._reported: set[tuple[str, str]] = set()

    def __call__(self, p: LoadProgress) -> None:
        share = p.done_bytes / p.total_bytes if p.total_bytes else 1.0
        if self.live:
            bar = "#" * int(share * 30)
            self.err.write(f"\rloading {p.model} → {p.tier} [{bar:<30}] {share:4.0%} "
                           f"{p.done_bytes / 1e6:.0f}/{p.total_bytes / 1e6:.0f} MB\x1b[K")
            self.err.flush()
        elif share >= 1.0 and (p.model, p.tier) not in self._reported:
            self._reported.add((p.model, p.tier))
            self.err.write(f"loaded {p.model} → {p.tier} ({p.total_bytes / 1e6:.0f} MB)\n")
            self.err.flush()

    def done(self) -> None:
        if self.live:
            self.err.write("\r\x1b[K")
            self.err.flush()


def load_engine(args: argparse.Namespace, err: TextIO) -> Any:
    from minions_local.profile import load_profile

    # A wrong profile fails here, in a fraction of a second, not after torch has loaded.
    from minions_local.planning.fitting import with_rpc

    profile = with_rpc(load_profile(args.profile, target=args.target, minions=args.minions),
                       getattr(args, "rpc", None), getattr(args, "rpc_split", None))
    from minions_local.planning.target_read_ahead import minions_known, read_profile_target_ahead

    # a GGUF held in RAM: its file is read (and its model and minions loaded) while torch is imported
    read_profile_target_ahead(profile, minions_known=minions_known(args.target, args.minions))
    from minions_local.engine import Engine

    try:  # the engine reports loading itself; transformers' own bar would draw over it
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    overrides: dict[str, Any] = {}
    if args.target:
        overrides["target"] = args.target
    if args.minions:
        overrides["minions"] = list(args.minions)
    overrides.update(rpc_overrides(args))
    bar = ProgressBar(err)
    try:
        engine = Engine.from_profile(args.profile, progress=bar, **overrides)
    finally:
        bar.done()
    plan = engine.memory_plan  # what was chosen for a target named on the command line, and why
    for line in plan.choices() if hasattr(plan, "choices") else []:
        err.write(f"minions-serve: {line.strip()}\n")
    return engine


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    err = sys.stderr
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not _is_loopback(args.host) and api_key is None:
        err.write(f"minions-serve: warning: serving on {args.host} without an API key: anyone who can reach this "
                  f"port can use the model. Set --api-key or ${API_KEY_ENV}.\n")
    try:
        sock = _listen(args.host, args.port)
    except OSError as error:
        err.write(f"minions-serve: cannot listen on {args.host}:{args.port}: {error.strerror or error}. "
                  f"Choose another --port (or --host).\n")
        return 1
    # SIGTERM while loading: leave like Ctrl+C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        engine = load_engine(args, err)
    except MinionsError as error:
        err.write(f"minions-serve: {error}\n")
        return 1
    except KeyboardInterrupt:
        err.write("minions-serve: interrupted while loading\n")
        return 130
    name = args.model_name or (Path(args.target).name if args.target else engine.profile_name) or "minions-local"
    settings = Settings(model_name=name, api_key=api_key, max_body_bytes=args.max_body_bytes,
                        max_waiting=args.queue, parallel=args.parallel)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    err.write(f"minions-serve: model '{name}' ready on http://{shown}:{port}/v1 "
              f"({'API key required' if api_key else 'no API key'}; Ctrl+C stops)\n")
    err.flush()
    return _serve(create_app(engine, settings), sock, args.log_level)


def _serve(app: Any, sock: socket.socket, log_level: str) -> int:
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    scheduler = app.state.scheduler

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            scheduler.stop()  # in-flight work ends after its pass instead of holding the shutdown

    stopped: list[int] = []
    # uvicorn restores these after its own shutdown and re-raises the signal it got:
    # recording it here makes a requested stop exit 0 instead of dying by the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _: stopped.append(s))
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, timeout_keep_alive=5,
                            server_header=False)
    Server(config).run(sockets=[sock])
    sys.stderr.write("minions-serve: stopped\n")
    return 0
