"""A target split over 2 RPC servers on loopback: ours (trees, and batched) against
llama.cpp's plain decoding and its speculative decoding over the same split, with 0, 1
and 5 ms of network delay added, and against one machine streaming the file from disk.

    python scripts/bench_rpc.py            # the 8B-shaped Q4_K_M (benchmarks/padded_gguf.py)
    python scripts/bench_rpc.py --quick    # the padded SmolLM2 'small' (174 MB), a few minutes

The servers are minions-rpc-servers (server/rpc_cli.py), each in a cgroup memory group
holding half the file and some room to compute, so the model fits only across both and
nothing streams; they hold every layer (--rpc-split 0,1,1: this machine keeps the
embeddings and the minions). llama.cpp's programs (`--rpc`, `-ngl 99 -ts 1,1`, `--poll 0`)
run over the same split on its own `rpc-server`s, without the kernel switches ours need. The delay is a proxy in front of each
server (benchmarks/delay_proxy.py: `delay` each way, so a round trip costs 2 * delay more),
not `tc netem`, which would slow every program's loopback on a shared box.

One machine: ours on the same file, no servers, in a memory group of half the file (its
layers stream from disk through the page cache, as on a machine that cannot hold it).
Greedy identity: ours over the split, with trees, against that run, token for token.

Reported per method: tok/s, tokens per pass, round trips per token (ours: counted by its
relays, a new graph shape's allocation questions included; llama.cpp's: one per server and
pass, not counted), and ours: KB received a token (the hidden states the head, kept here,
reads). On one 2-core box the servers and the client share the cores, so with no delay
the split is compute-bound; the delays show what the network costs each method.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_big_gguf import Limit, chats, ours, rendered, tool
from benchmarks.delay_proxy import DelayProxy
from benchmarks.llama_tools import SCRIPTS, ToolRun, completion, speculative, tools_dir
from benchmarks.memlimit import MemoryGroup, NoMemoryGroup, group_name

GB = 1e9
SERVER_ROOM = 0.6e9
"""Bytes a server needs beyond its half of the weights: its KV cache and compute buffers."""
ENGINE_ROOM = 1.0e9
"""Bytes our engine's process needs beyond weights (Python, torch, the minions; its plan keeps
0.5 GB for itself, and at 0.8 GB the quick file did not fit): one machine gets half the file
plus this, as the client of the split has it beside its minions."""


class Servers:
    """2 RPC servers on loopback, each in a memory group of half `model` + room: ours
    (minions-rpc-server, the kernel switches that keep rows exact), or with `stock` the
    llama.cpp build's own `rpc-server` without them, for llama.cpp's runs (the switches
    make its lone rows 2-3x slower; measured here: 575 against 208 ms a token)."""

    def __init__(self, model: Path, threads: int, cache: Path, stock: Path | None = None) -> None:
        self.procs, self.groups, self.endpoints, self.note = [], [], [], ""
        limit = int(model.stat().st_size / 2 + SERVER_ROOM)
        for i in range(2):
            group = None
            try:
                group = MemoryGroup.create(group_name(f"rpc{i}"))
                group.set_limit(limit)
            except NoMemoryGroup as err:
                self.note = f"servers without a memory limit: {err}"
            port = _free_port()
            env = {k: v for k, v in os.environ.items() if not (stock and k.startswith("GGML_CPU_TILED_MM"))}
            if stock:
                argv = [str(stock), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads), "-c"]
                env["LLAMA_CACHE"] = str(cache / f"stock{i}")
            else:
                argv = [sys.executable, "-m", "minions_local.server.rpc_cli", "--port", str(port), "--threads",
                        str(threads), "--cache", str(cache / str(i))]
            self.procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                               preexec_fn=(lambda g=group: g.add(0)) if group else None))
            self.groups.append(group)
            self.endpoints.append(f"127.0.0.1:{port}")
        from minions_local.backends.llama_rpc import RemoteError, handshake

        for endpoint in self.endpoints:
            for _ in range(300):
                try:
                    handshake(endpoint, 2.0, probes=1)
                    break
                except RemoteError:
                    time.sleep(0.2)
        self.limit = limit

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        for group in self.groups:
            if group is not None:
                group.remove()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def llama_rpc(run: ToolRun, endpoints: list[str]) -> dict:
    out = tool(run, Limit(0, []))
    if "tok_s" in out:  # not counted: llama.cpp's pass pays one round trip per server (its boundaries)
        out["round_trips_per_token"] = len(endpoints) / out["tokens_per_pass"]
    return out


def rpc_options(endpoints: list[str], draft: bool) -> list[str]:
    """llama.cpp's options for every layer on the servers, in halves (the draft stays here).
    `--poll 0`: its threads otherwise spin waiting for work (level 50) while the servers
    compute on the same 2 cores, which made it 50x slower here than the servers allow."""
    return ["--rpc", ",".join(endpoints), "-ngl", "99", "-ts", "1,1", "--poll", "0"] + (
        ["-ngld", "0", "--poll-draft", "0"] if draft else [])


def ours_split(files: dict, convs: list, args, endpoints: list[str], batch: str = "") -> dict:
    extra = ["--rpc", ",".join(endpoints), "--rpc-split", "0,1,1"] + (["--batch", batch] if batch else [])
    result = ours(files["target"], [str(files["draft"]), "ngram"], convs, args.max_new, Limit(0, []),
                  extra_args=extra)
    if "chats" in result:
        tokens = sum(len(c["tokens"]) for c in result["chats"])
        result["round_trips_per_token"] = sum(c["network"][0] for c in result["chats"]) / max(tokens, 1)
        result["kb_in_per_token"] = sum(c["network"][2] for c in result["chats"]) / max(tokens, 1) / 1e3
        for b in result.get("batches", []):
            b["tok_s"] = b["tokens"] / b["seconds"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the padded SmolLM2 'small' instead of the 8B shape")
    parser.add_argument("--delays", default="0,1,5", help="ms added each way (default: 0,1,5)")
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", default="4,8", help="ours batched at these request counts (no delay, 5 ms)")
    args = parser.parse_args()
    from benchmarks.padded_gguf import cache_dir, padded_gguf, source_gguf

    target = padded_gguf("small" if args.quick else "8b", "q4_k_m")
    files = {"target": target, "draft": source_gguf()}
    convs = chats(args.prompts)
    text = rendered(files["draft"], convs[0])
    tools = tools_dir()
    size = target.stat().st_size
    print(f"target {target.name} ({size / GB:.2f} GB), draft {files['draft'].name}", file=sys.stderr)
    results: dict = {}
    delays = [float(d) for d in args.delays.split(",")]
    for stock in (None, tools / "rpc-server"):  # ours on our servers, then llama.cpp on its own
        servers = Servers(target, args.threads, cache_dir() / "rpc-cache", stock)
        try:
            for delay in delays:
                proxies = [DelayProxy(e, delay / 1000) for e in servers.endpoints] if delay else []
                endpoints = [p.endpoint for p in proxies] or servers.endpoints
                row = results.setdefault(f"{delay:g}ms", {})
                if stock is None:
                    row["ours"] = ours_split(files, convs, args, endpoints, args.batch if delay in (0, 5) else "")
                else:
                    row["llama.cpp rpc"] = llama_rpc(completion(
                        tools, target, text, max_new=args.max_new, threads=args.threads, ctx=2048, repack=False,
                        group=None, extra=rpc_options(endpoints, False)), endpoints)
                    row["llama.cpp spec rpc"] = llama_rpc(speculative(
                        tools, target, files["draft"], text, max_new=args.max_new, threads=args.threads, ctx=2048,
                        repack=False, group=None, extra=rpc_options(endpoints, True)), endpoints)
                for p in proxies:
                    p.close()
                print(f"{delay:g} ms: " + ", ".join(f"{k} {v.get('tok_s', 0):.2f} tok/s" for k, v in row.items()),
                      file=sys.stderr)
        finally:
            servers.close()
    results["one machine"] = ours(target, [str(files["draft"]), "ngram"], convs, args.max_new,
                                  Limit((size / 2 + ENGINE_ROOM) / GB, [target]))
    report(results, servers, args, size)


def report(results: dict, servers: Servers, args, size: int) -> None:
    def rate(row: str, method: str) -> float:
        return results.get(row, {}).get(method, {}).get("tok_s", 0.0) if row != "one machine" \
            else results["one machine"].get("tok_s", 0.0)

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if a and b else None

    print(f"\n{'delay':>6} {'method':<22} {'tok/s':>7} {'tok/pass':>8} {'trips/tok':>9} {'KB in/tok':>9}")
    for row, methods in results.items():
        if row == "one machine":
            methods = {"ours, streaming": methods}
        for name, r in methods.items():
            print(f"{row:>6} {name:<22} {r.get('tok_s', 0):>7.2f} {r.get('tokens_per_pass', 0):>8.2f} "
                  f"{r.get('round_trips_per_token', 0):>9.2f} {r.get('kb_in_per_token', 0):>9.1f} {r.get('error', '')}")
            for b in r.get("batches", []):
                print(f"{row:>6} {'ours x' + str(b['requests']):<22} {b['tok_s']:>7.2f}")
    split, alone = results.get("0ms", {}).get("ours", {}), results["one machine"]
    from bench_big_gguf import identical

    line = {
        "bench": "rpc", "quick": args.quick, "target_bytes": size, "server_limit_bytes": servers.limit,
        "note": servers.note,
        "tok_s": {row: {m: round(r.get("tok_s", 0.0), 3) for m, r in methods.items()}
                  for row, methods in results.items() if row != "one machine"},
        "one_machine_tok_s": round(alone.get("tok_s", 0.0), 3),
        "vs_llama_cpp_rpc": ratio(rate("0ms", "ours"), rate("0ms", "llama.cpp rpc")),
        "vs_llama_cpp_rpc_5ms": ratio(rate("5ms", "ours"), rate("5ms", "llama.cpp rpc")),
        "vs_llama_cpp_spec_rpc_5ms": ratio(rate("5ms", "ours"), rate("5ms", "llama.cpp spec rpc")),
        "vs_one_machine_streaming": ratio(rate("0ms", "ours"), alone.get("tok_s", 0.0)),
        "greedy_identical": identical(split, alone),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(SCRIPTS))
    main()
