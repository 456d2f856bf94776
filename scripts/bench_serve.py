#!/usr/bin/env python
"""The same request, the same reply, through a real `minions-serve`: and what 8 clients
at once get against the same 8 one at a time.

    python scripts/bench_serve.py                               # cpu-demo-disk, bf16
    python scripts/bench_serve.py --profile cpu-demo --dtype float32 --max-new 32

A server process is started as a user starts it, and driven with the official openai
client, greedy. The reference for every reply is the target alone reading that chat
from an empty cache (Engine.from_profile(..., minions=[]), reset before each). Modes,
in one server's life, so that each meets the caches the ones before it left:
  in order      the prompts one at a time
  reversed      again, in reverse order
  interleaved   one at a time, each after an unrelated long conversation
  together      all at once (8 clients)
Then `--rounds` more rounds of (in order, together), back to back, whose replies are
checked too: the aggregate tok/s of `together` against `in order` is their median ratio
(a disk tier's read speed drifts within minutes on a shared box; a round's two halves
meet the same drift). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.chat_prompts import CHAT_PROMPTS
from benchmarks.reference import profile_copy, reference_replies

READY = re.compile(r"ready on http://127\.0\.0\.1:(\d+)/v1")
LONG = ("Here are my notes from the week; read them and tell me which three tasks matter most.\n\n"
        + "\n".join(f"- Day {d}: answered mail, fixed the build, met the team about the Q{d % 4 + 1} plan."
                    for d in range(1, 40)))


def start_server(profile: str, parallel: int) -> tuple[subprocess.Popen, int, list[str]]:
    command = [sys.executable, "-m", "minions_local.server", "--profile", profile, "--port", "0",
               "--parallel", str(parallel), "--queue", str(4 * parallel)]
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, errors="replace", env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        found = next((READY.search(line) for line in list(lines) if READY.search(line)), None)
        if found:
            return proc, int(found.group(1)), lines
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("minions-serve did not get ready:\n" + "".join(lines[-40:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu-demo-disk")
    ap.add_argument("--dtype", default=None, help="the target's compute dtype (default: the profile's)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds (in order, together) for the ratio")
    ap.add_argument("--server-log", action="store_true", help="print the server's line for each reply (stderr)")
    args = ap.parse_args()
    import openai

    chats = [[{"role": "user", "content": text}] for _, text in CHAT_PROMPTS[:args.prompts]]
    with tempfile.TemporaryDirectory() as folder:
        profile = profile_copy(args.profile, Path(folder), dtype=args.dtype)
        reference = reference_replies(profile, chats, args.max_new)
        proc, port, log = start_server(profile, parallel=len(chats))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)

    first_token: dict[str, list[float]] = {}
    """Seconds from each request to its first streamed text, by mode."""

    def ask(m: list[dict], mode: str = "") -> tuple[str, int]:
        start, parts, tokens = time.perf_counter(), [], 0
        for chunk in client.chat.completions.create(model="m", messages=m, max_tokens=args.max_new, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                if not parts:
                    first_token.setdefault(mode, []).append(time.perf_counter() - start)
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return "".join(parts), tokens

    results: dict[str, dict] = {}
    try:
        def record(name: str, texts: dict[int, str], tokens: int, seconds: float) -> float:
            parted = [i for i in sorted(texts) if texts[i] != reference[i]]
            results[name] = {"identical": len(texts) - len(parted), "of": len(texts),
                             "tok_s": round(tokens / seconds, 2), "parted": parted,
                             "ttft_s": round(statistics.median(first_token.get(name) or [0.0]), 3)}
            return tokens / seconds

        def one_at_a_time(name: str, order: list[int], between: list[dict] | None = None) -> float:
            texts, tokens, start = {}, 0, time.perf_counter()
            for i in order:
                if between is not None:
                    ask(between)
                texts[i], n = ask(chats[i], name)
                tokens += n
            return record(name, texts, tokens, time.perf_counter() - start)

        def together(name: str) -> float:
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(len(chats)) as pool:
                answers = list(pool.map(ask, chats, [name] * len(chats)))
            return record(name, {i: a[0] for i, a in enumerate(answers)}, sum(a[1] for a in answers),
                          time.perf_counter() - start)

        order = list(range(len(chats)))
        one_at_a_time("in_order", order)
        one_at_a_time("reversed", order[::-1])
        one_at_a_time("interleaved", order, between=[{"role": "user", "content": LONG}])
        together("together")
        ratios = [together(f"together_{r}") / one_at_a_time(f"in_order_{r}", order)
                  for r in range(1, args.rounds + 1)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    ratio = statistics.median(ratios) if ratios else results["together"]["tok_s"] / results["in_order"]["tok_s"]
    if args.server_log:
        print("".join(line for line in log if "tokens in" in line), file=sys.stderr)
    print(f"{'mode':<12} {'identical':>9} {'tok/s':>8} {'TTFT s':>7}  parted")
    for name, r in results.items():
        print(f"{name:<12} {r['identical']:>5}/{r['of']:<3} {r['tok_s']:>8.2f} {r['ttft_s']:>7.3f}  {r['parted']}")
    spread = f" (rounds: {', '.join(f'x{r:.2f}' for r in ratios)})" if ratios else ""
    print(f"{len(chats)} clients at once vs one at a time: x{ratio:.2f}{spread}")
    exact = all(r["identical"] == r["of"] for r in results.values())
    print(json.dumps({"profile": args.profile, "dtype": args.dtype or "profile", "max_new": args.max_new,
                      "modes": results, "together_vs_one_at_a_time": round(ratio, 3),
                      "round_ratios": [round(r, 3) for r in ratios], "all_identical": exact}))


if __name__ == "__main__":
    main()
