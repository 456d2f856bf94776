#!/usr/bin/env python
"""Many chat requests at once: continuous batching against serving them one at a time.

    python scripts/bench_batch.py                         # cpu-demo-disk, 1/2/4/8/16 requests x 128 tokens
    python scripts/bench_batch.py --profile cpu-demo      # the RAM tier
    python scripts/bench_batch.py --quick                 # 1/4/8 requests x 48 tokens, greedy only
    python scripts/bench_batch.py --tiny                  # seconds: tiny random stand-ins (the tests' run)

Workload: N concurrent chat requests (the benchmark's own prompts, benchmarks/
chat_prompts.py, cycled past 12), all submitted at time 0, `--max-new` new tokens
each, greedy and at temperature 0.7 (unseeded, as in the chat). Methods, interleaved
at every concurrency (their order rotated round by round):
- one-at-a-time: today's serving, each request in turn with adaptive speculation;
- batched: continuous batching with trees (Engine.stream_batch, the default policy);
- batched-no-trees: the same shared passes with no minions (plain batched decoding);
- the peers in benchmarks/batch_peers.py where they are installed (--no-peers skips);
- the physical bound on the disk tier: tokens per pass x raw read speed / bytes per pass.
A single request decoded without trees (our autoregressive) runs again beside every
concurrency's runs: the 16-request goal's reference is all of those runs together.
Reports aggregate tok/s, each request's own speed (median, p10: its tokens over the
time its reply streamed) and time to first token (queueing included), ratios to
one-at-a-time at the same concurrency, the issue's goal lines, a PNG of aggregate tok/s
against concurrency, and ONE JSON line. Greedy replies of every method of ours are
compared with the one-at-a-time replies (lossless per request).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks.batch_methods import Batched, OneAtATime  # noqa: E402
from benchmarks.chat_prompts import CHAT_PROMPTS, calibration_prompt, chat_prompts  # noqa: E402
from benchmarks.choices import TINY_PROFILE, resolve_profile, standin_overrides  # noqa: E402
from benchmarks.llama_child import MethodFailed  # noqa: E402
from benchmarks.raw_reads import raw_read_gbps, stream_pack_files  # noqa: E402
from minions_local import Engine  # noqa: E402
from minions_local.speculation.budget import FixedBudget  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TEMPERATURE = 0.7
GOALS = {4: 1.8, 8: 2.5, 16: 3.5}
"""Batched aggregate tok/s over one-at-a-time serving, by concurrency (issue 24)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="cpu-demo-disk")
    p.add_argument("--concurrency", default=None, help="e.g. '1,2,4,8,16' (default; --quick: '1,4,8')")
    p.add_argument("--max-new", type=int, default=None, help="new tokens per request (default 128; --quick 48)")
    p.add_argument("--modes", default=None, help="'greedy,sampled' (default; --quick: greedy)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help="tiny random stand-ins: checks the machinery in seconds")
    p.add_argument("--no-peers", action="store_true", help="only our methods")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=REPO / "bench_out")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)  # noqa: E731
    levels = [int(n) for n in (args.concurrency or ("1,2" if args.tiny else "1,4,8" if args.quick
                                                     else "1,2,4,8,16")).split(",")]
    max_new = args.max_new or (6 if args.tiny else 48 if args.quick else 128)
    modes = (args.modes or ("greedy" if args.quick or args.tiny else "greedy,sampled")).split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    notes: list[str] = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-batch-"))  # stand-ins, exports: removed at the end
    try:
        return _run(args, levels, max_new, modes, notes, workdir, log)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(args, levels: list[int], max_new: int, modes: list[str], notes: list[str], workdir: Path, log) -> int:
    profile = resolve_profile(TINY_PROFILE if args.tiny else args.profile, None)
    overrides = standin_overrides(workdir, notes) if args.tiny else {}
    log(f"loading {profile}")
    engine = Engine.from_profile(profile, **overrides)
    plain = _plain_engine(engine)
    methods = [OneAtATime("one-at-a-time", engine), Batched("batched", engine), Batched("batched-no-trees", plain)]
    if not args.no_peers:
        methods += _peers(engine, profile, max_new, max(levels), notes, workdir)
    tokenizer = engine.tokenizer
    prompts = chat_prompts(tokenizer, len(CHAT_PROMPTS))
    warm = calibration_prompt(tokenizer).ids
    for m in methods:  # warm-up: kernel selection, page cache, allocations
        m.run([warm], 4, 0.0, 0)
    for m in methods[1:3]:  # every slot a run will use, made once, as a running server has them
        m.run([warm] * max(levels), 2, 0.0, 0)
    packs, readers = stream_pack_files(engine.decoder.target.model)
    raw = [raw_read_gbps(packs, readers)] if packs else []

    results: dict[tuple[str, int, str], object] = {}
    lone_runs = []  # single-request autoregressive runs: the 16-request goal's reference
    for level in levels:
        batch = [prompts[i % len(prompts)].ids for i in range(level)]
        for r, mode in enumerate(modes):
            temperature = 0.0 if mode == "greedy" else TEMPERATURE
            order = methods[r % len(methods):] + methods[:r % len(methods)]
            for m in order:
                try:
                    out = m.run(batch, max_new, temperature, seed=level * 100 + r)
                except MethodFailed as err:  # a peer's llama.cpp child died: the others go on
                    notes.append(f"{m.name} N={level} {mode} failed: {err}")
                    continue
                results[(m.name, level, mode)] = out
                log(f"N={level:<2} {mode:<7} {m.name:<22} {out.aggregate_tokens_per_second:7.2f} tok/s "
                    f"({out.tokens} tokens in {out.wall:.1f} s)")
                if m.name == "batched-no-trees" and level == 1:
                    lone_runs.append(out)
            if level > 1:  # the autoregressive reference again, beside this concurrency's runs
                out = methods[2].run(batch[:1], max_new, temperature, seed=level * 100 + r)
                lone_runs.append(out)
                log(f"N={level:<2} {mode:<7} {'(one request, no trees)':<22} {out.aggregate_tokens_per_second:7.2f} tok/s")
    if packs:
        raw.append(raw_read_gbps(packs, readers))
    raw_gbps = max(raw) if raw else None
    for m in methods:  # the peers' llama.cpp children and their memory groups
        if hasattr(m, "close"):
            m.close()
    report = _report(results, methods, levels, modes, raw_gbps, notes, lone_runs)
    plot = _plot(args.out, results, methods, levels, modes, profile, max_new)
    print(f"plot: {plot}")
    for note in notes:
        print(f"note: {note}")
    print(json.dumps({"profile": profile, "max_new_tokens": max_new, "concurrency": levels, "modes": modes,
                      "temperature": TEMPERATURE, "raw_read_gbps": raw_gbps, **report}))
    return 0


def _plain_engine(engine: Engine) -> Engine:
    """Our batched decoding without trees, on the same loaded target."""
    from benchmarks.methods import engine_sharing_target

    return engine_sharing_target(engine, [], FixedBudget(nodes=0, depth=0))


def _peers(engine: Engine, profile: str, max_new: int, most: int, notes: list[str], workdir: Path) -> list:
    try:
        from benchmarks.batch_peers import peer_methods
    except ImportError as err:
        notes.append(f"peers skipped: {err}")
        return []
    return peer_methods(engine, profile=profile, max_new=max_new, most=most, notes=notes, workdir=workdir)


def _report(results, methods, levels, modes, raw_gbps, notes, lone_runs) -> dict:
    # The same model in the same math as ours (the llama.cpp peers run the Q4_1 file: another model).
    comparable = {"one-at-a-time", "batched", "batched-no-trees", "transformers batch"}
    table = {}
    print(f"\n{'N':>3} {'mode':<8} {'method':<24} {'agg tok/s':>9} {'x serial':>8} {'req tok/s med':>13} "
          f"{'p10':>6} {'ttft med s':>10} {'tok/pass':>8} {'= alone':>7}")
    for level in levels:
        for mode in modes:
            serial = results[("one-at-a-time", level, mode)]
            for m in methods:
                out = results.get((m.name, level, mode))
                if out is None:
                    continue
                per = out.per_request()
                same = None
                if mode == "greedy" and m.name in comparable:
                    same = sum(a.tokens == b.tokens for a, b in zip(out.requests, serial.requests))
                ratio = out.aggregate_tokens_per_second / serial.aggregate_tokens_per_second
                row = {"aggregate_tok_s": round(out.aggregate_tokens_per_second, 2),
                       "vs_one_at_a_time": round(ratio, 3),
                       **{k: round(v, 3) for k, v in per.items()},
                       "tokens_per_pass": round(out.tokens_per_pass, 2) if out.steps else None,
                       "bytes_per_pass": round(out.bytes_per_pass) if out.steps else None,
                       "identical_to_alone": same}
                if raw_gbps and out.steps and out.bytes_per_pass:
                    row["physical_bound_tok_s"] = round(out.tokens_per_pass * raw_gbps * 1e9 / out.bytes_per_pass, 1)
                table[f"{m.name}/{level}/{mode}"] = row
                print(f"{level:>3} {mode:<8} {m.name:<24} {row['aggregate_tok_s']:>9} {ratio:>8.2f} "
                      f"{per['median_tok_s']:>13.2f} {per['p10_tok_s']:>6.2f} {per['median_ttft_s']:>10.2f} "
                      f"{row['tokens_per_pass'] or '':>8} {'' if same is None else f'{same}/{level}':>7}")
    goals = _goals(results, levels, modes, lone_runs)
    for key, check in goals.items():
        state = {True: "PASS", False: "FAIL", None: "n/a"}[check["passed"]]
        print(f"goal {key}: {check['value']} (goal {check['goal']}) {state}")
    lone = [round(r.aggregate_tokens_per_second, 2) for r in lone_runs]
    if lone:
        print(f"one request, no trees, every run (the autoregressive reference): {lone} tok/s")
    return {"results": table, "goals": goals, "autoregressive_alone_tok_s": lone}


def _goals(results, levels, modes, lone_runs=()) -> dict:
    def agg(name, level):
        runs = [results[(name, level, mode)] for mode in modes if (name, level, mode) in results]
        return sum(r.tokens for r in runs) / sum(r.wall for r in runs) if runs else None

    goals = {}
    for level, goal in GOALS.items():
        if level in levels:
            value = agg("batched", level) / agg("one-at-a-time", level)
            goals[f"batched_vs_one_at_a_time_{level}"] = {"value": round(value, 3), "goal": goal,
                                                          "passed": value >= goal}
    if 1 in levels:
        alone = agg("batched", 1) / agg("one-at-a-time", 1)
        goals["lone_request_vs_today"] = {"value": round(alone, 3), "goal": 0.95, "passed": alone >= 0.95}
    if 16 in levels and lone_runs:
        # Against every single-request autoregressive run of the benchmark (one at N=1,
        # one beside each concurrency's runs, per mode): on a shared VM one 64-token
        # run swung from 3.8 to 5.1 tok/s between runs, enough to move this ratio by 30%.
        value = agg("batched", 16) / (sum(r.tokens for r in lone_runs) / sum(r.wall for r in lone_runs))
        goals["batched_16_vs_single_autoregressive"] = {"value": round(value, 3), "goal": 8.0, "passed": value >= 8}
    if 4 in levels and 1 in levels:
        med = [results[("batched", 4, m)].per_request()["median_tok_s"] / results[("batched", 1, m)].per_request()[
            "median_tok_s"] for m in modes if results[("batched", 1, m)].per_request()["median_tok_s"]]
        value = min(med) if med else None
        goals["median_request_speed_at_4_vs_alone"] = {"value": None if value is None else round(value, 3),
                                                       "goal": 0.5, "passed": None if value is None else value >= 0.5}
    return goals


def _plot(out: Path, results, methods, levels, modes, profile: str, max_new: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for m in methods:
            points = [(n, results[(m.name, n, mode)].aggregate_tokens_per_second) for n in levels
                      if (m.name, n, mode) in results]
            if points:
                ax.plot(*zip(*points), marker="o", label=m.name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_title(f"{profile}, {mode}, {max_new} new tokens")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"bench-batch-{profile}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
