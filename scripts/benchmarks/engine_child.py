"""Our engine as a benchmark peer in a child process of its own (bench_big_gguf.py), so
that it can run inside a memory group as llama.cpp does, with its reads and its peak
memory its own.

    python -m benchmarks.engine_child --target T.gguf --minions D.gguf,ngram \\
        --prompts prompts.json --max-new 64 [--tree-pass 40] --out result.json

It loads the engine as a newcomer does (`Engine.from_profile("cpu-demo", target=...)`:
the plan fitted to this machine's memory, the memory group's limit included), answers
each chat from an empty cache, greedy, and writes what it measured as JSON. With
`--tree-pass N` it then times a pass of an N-node tree over the last chat (the engine's
own cost, whatever the minions' acceptance). With `--rpc A,B [--rpc-split 0,1,1]` the
target is split over those minions-rpc-servers (bench_rpc.py): each chat also reports the
round trips and bytes its passes cost, and `--batch 4,8` then answers that many chats at
once (sharing every pass) and reports their tokens/s together.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

from benchmarks.llama_child import proc_io_bytes


def _tree_pass_seconds(engine, context: list[int], nodes: int, repeats: int = 3) -> float:
    """The median time of the target verifying a tree of `nodes` draft nodes below
    `context` (a bushy tree of made-up tokens; its acceptance does not matter)."""
    from minions_local.core.tree import TokenTree

    target = engine.decoder.target
    times = []
    for r in range(repeats):
        tree = TokenTree.from_root(context[-1])
        for i in range(nodes):
            tree.add(i // 3, (context[i % len(context)] + 7 * r + i) % target.vocab_size, score=1.0 / (i + 1))
        start = time.perf_counter()
        target.verify(context, tree)
        times.append(time.perf_counter() - start)
        target.commit(tree, [0])
        context = context + [context[-1]]
    return statistics.median(times)


def _profile(kernel: str, context: int = 0, speculation: str = "") -> str:
    """cpu-demo, or a copy of it whose GGUF target computes with `kernel` (gguf_kernel),
    holds `context` tokens (context_tokens; 0 keeps the profile's: the peers' context size)
    and whose [speculation] gets the `speculation` settings ("key=value,...", e.g.
    "adaptive=false,budget=40": a fixed tree, to see what the cost model's choice is worth)."""
    if kernel == "auto" and not context and not speculation:
        return "cpu-demo"
    import re
    import tempfile

    from minions_local.profile.loader import find_profile_file

    text = find_profile_file("cpu-demo").read_text()
    if kernel != "auto":
        text = text.replace("[target]\n", f'[target]\ngguf_kernel = "{kernel}"\n', 1)
    if context:
        text, found = re.subn(r"(?m)^context_tokens = \d+", f"context_tokens = {context}", text, count=1)
        assert found, "cpu-demo.toml names no context_tokens"
    if speculation:  # edited within [speculation] alone: a key of another table keeps its value
        head, table, rest = text.partition("[speculation]\n")
        assert table, "cpu-demo.toml has no [speculation]"
        end = next(re.finditer(r"(?m)^\[", rest), None)  # the next table, if one follows
        body, tail = (rest[:end.start()], rest[end.start():]) if end else (rest, "")
        for setting in filter(None, speculation.split(",")):
            key, value = (part.strip() for part in setting.split("=", 1))
            body, found = re.subn(rf"(?m)^{re.escape(key)} = .*$", f"{key} = {value}", body, count=1)
            if not found:
                body = f"{key} = {value}\n" + body
        text = head + table + body + tail
    path = Path(tempfile.mkdtemp()) / f"cpu-demo-{kernel}-{context}.toml"
    path.write_text(text)
    return str(path)


def run(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    minions = [m for m in args.minions.split(",") if m]
    split = {"rpc": args.rpc.split(",")} if args.rpc else {}
    if args.rpc_split:
        split["rpc_split"] = [float(x) for x in args.rpc_split.split(",")]
    profile = _profile(args.kernel, args.context, args.speculation)
    # Loaded as minions-chat and minions-serve load it (tui/bridge.py, server/cli.py): a GGUF
    # target held in RAM is read from here on, while torch is imported.
    from minions_local.planning.target_read_ahead import read_named_profile_target_ahead

    read_named_profile_target_ahead(profile, target=args.target, minions=minions, **split)
    from minions_local import Engine
    from minions_local.core.events import DoneEvent, TokenEvent

    engine = Engine.from_profile(profile, target=args.target, minions=minions, **split)
    load = time.perf_counter() - start
    network = getattr(engine.decoder.target, "network_counters", lambda: (0, 0, 0))
    chats = []
    read_before = proc_io_bytes()
    streamed_before = engine.decoder.target.bytes_streamed()  # the load's passes streamed too
    for messages in json.loads(Path(args.prompts).read_text()):
        engine.reset()
        before = network()
        begun, first, generation = time.perf_counter(), None, None
        for event in engine.stream_chat(messages, max_new_tokens=args.max_new):
            if isinstance(event, TokenEvent) and first is None:
                first = time.perf_counter() - begun
            elif isinstance(event, DoneEvent):
                generation = event.generation
        seconds = time.perf_counter() - begun
        chats.append({
            "tokens": list(generation.token_ids), "text": generation.text, "seconds": seconds,
            "ttft": first or seconds, "passes": len(generation.steps),
            "tree_sizes": [s.tree_size for s in generation.steps],
            "accepted": [s.accepted for s in generation.steps],
            "network": [b - a for a, b in zip(before, network())],  # round trips, bytes sent, received
        })
    target = engine.decoder.target
    out = {
        "load_seconds": load, "chats": chats, "minions": engine.minion_names,
        "plan": engine.memory_plan_text(),
        "bytes_streamed": target.bytes_streamed() - streamed_before,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "disk_read": proc_io_bytes() - read_before,
        "disk_written": proc_io_bytes("write_bytes"),
    }
    for n in [int(x) for x in args.batch.split(",") if x]:
        conversations = (json.loads(Path(args.prompts).read_text()) * n)[:n]
        engine.reset()
        before, begun = network(), time.perf_counter()
        done = engine.chat_batch(conversations, max_new_tokens=args.max_new, parallel=n)
        seconds = time.perf_counter() - begun
        out.setdefault("batches", []).append({
            "requests": n, "tokens": sum(len(g.token_ids) for g in done), "seconds": seconds,
            "network": [b - a for a, b in zip(before, network())]})
    if args.tree_pass:
        context = engine.prepare_chat(json.loads(Path(args.prompts).read_text())[-1]).ids
        engine.reset()
        out["tree_pass_seconds"] = _tree_pass_seconds(engine, context, args.tree_pass)
        out["one_row_seconds"] = _tree_pass_seconds(engine, context, 0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--minions", default="")
    parser.add_argument("--prompts", required=True, help="a JSON list of chats (lists of messages)")
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--tree-pass", type=int, default=0)
    parser.add_argument("--kernel", default="auto", help="the GGUF target's gguf_kernel (auto: llama.cpp)")
    parser.add_argument("--context", type=int, default=0, help="tokens the target's cache holds (0: the profile's)")
    parser.add_argument("--speculation", default="", help="[speculation] settings, key=value,... "
                        "(e.g. adaptive=false,budget=40)")
    parser.add_argument("--rpc", default="", help="split the target over these servers (host:port,...)")
    parser.add_argument("--rpc-split", default="", help="this machine's share, then each server's")
    parser.add_argument("--batch", default="", help="also answer this many chats at once (e.g. 4,8)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    Path(args.out).write_text(json.dumps(run(args)))


if __name__ == "__main__":
    main()
