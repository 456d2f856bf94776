#!/usr/bin/env python
"""The GPU check: one call of at most 8 minutes on a lent GPU machine (issue 33).

Here (the CPU box), around the ONE device call:
    python scripts/gpu_check.py --due        # is a GPU run of the current code in docs/gpu/?
    python scripts/gpu_check.py --manifest   # what would travel (<= 60 MiB), carry, command
    python scripts/gpu_check.py --slim       # wheels into .gpu/wheels; other minions out of the index
    device run: command as --slim prints it, carry [".gpu/wheels"], timeout_s 540
    python scripts/gpu_check.py --unslim     # ALWAYS, right after the call
    python scripts/gpu_check.py --keep /work/.device/.../gpu_check.json   # into docs/gpu/, dated
There:
    python3 scripts/gpu_check.py --out $OUT [--budget-s 470]
The rehearsal (CI runs it; every step but CUDA itself):
    python scripts/gpu_check.py --device cpu --quick --out /tmp/rehearsal

Steps, in order; one whose time is not left in the budget is skipped, not started, and
each runs in a process of its own under what is left, so a hung step cannot take the
call's results with it. gpu_check.json is rewritten after every step; with log.txt and
curve-70b.png that is all that comes back (the tool returns at most 8 files).
  env    GPU, driver, torch, free VRAM, pinned-RAM -> GPU copy GB/s
  tests  pytest -m gpu on the demo family (tests/gpu: greedy identity with the target
         resident and streamed from pinned RAM, the sampling law; partings measured)
  curve  a 70B-shaped int4 and bf16 stack from pinned RAM: pass time by tree size and
         by resident layers, copy efficiency, beside the rtx4090-70b projection (PNG)
  chat   a speculative chat on the demo family, target from pinned RAM, minion in VRAM:
         greedy identical to the target alone, tokens per pass, tok/s vs autoregressive
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpucheck import travel
from gpucheck.record import Record

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
STEPS = ("env", "tests", "curve", "chat")
# Seconds a step needs at the least (on a GPU, in a rehearsal): with less left it is
# skipped. A step may run until what the later steps need is all that is left, and at
# most MAX_S (a hung test must not eat the call); the curve, measured point by point
# against its deadline, takes whatever that leaves. On an H100 the whole check should
# take ~5-6 minutes: env ~15 s, tests ~90, curve ~200, chat ~30, plus the imports.
NEEDS = {"env": (25, 15), "tests": (150, 45), "curve": (90, 15), "chat": (60, 20)}
MAX_S = {"env": 90, "tests": 240, "curve": None, "chat": 150}
TEST_PATHS = ("tests/gpu", "tests/offload/test_offload_stream.py")
LOG_CAP = 2 << 20  # per step: log.txt must come back (16 MiB a file), so a runaway step's output is cut


def step_command(name: str, args: argparse.Namespace, result: Path, seconds: float) -> tuple[list[str], dict]:
    """The process one step runs in, and its environment."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.device == "cpu":
        # One torch thread, as tests/conftest.py sets: on a 2-core box with any other
        # load, OpenMP's spinning makes each small matmul ~10x slower.
        env["OMP_NUM_THREADS"] = "1"
    if name == "tests":
        env["MINIONS_GPU_RECORD"] = str(result.with_suffix(".jsonl"))
        if args.device == "cpu":
            env["MINIONS_GPU_TEST_DEVICE"] = "cpu"  # the GPU tests, rehearsed (tests/gpu/)
        if args.quick:
            env["MINIONS_GPU_CHECK_QUICK"] = "1"
        return [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs", *TEST_PATHS], env
    # The step's own deadline comes 15 s before the kill: time to save and tear down.
    command = [PY, str(Path(__file__).resolve()), "--step", name, "--device", args.device, "--result", str(result),
               "--deadline-s", f"{max(5.0, seconds - 15):.0f}"]
    return command + (["--quick"] if args.quick else []), env


def step_seconds(name: str, args: argparse.Namespace, left: float) -> float:
    """How long step `name` may run with `left` seconds of budget (see NEEDS)."""
    cpu = args.device == "cpu"
    later = sum(NEEDS[s][cpu] for s in args.steps[args.steps.index(name) + 1:])
    seconds = max(NEEDS[name][cpu], left - later - 10)
    return min(seconds, MAX_S[name]) if MAX_S[name] else seconds


def run_step(name: str, args: argparse.Namespace, work: Path, log, left: float) -> dict:
    seconds = step_seconds(name, args, left)
    result = work / f"{name}.json"
    command, env = step_command(name, args, result, seconds)
    log.write(f"\n===== {name}: {' '.join(command)}\n")
    log.flush()
    start = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=seconds)
        rc, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as err:  # past the budget: keep what it printed and saved
        rc, output = "timeout", err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else \
            (err.stdout or "")
    log.write(output[-LOG_CAP:])
    log.flush()
    out = {"rc": rc, "seconds": round(time.monotonic() - start, 1)}
    if result.exists():
        out["result"] = json.loads(result.read_text())
    if name == "tests":
        out.update(pytest_summary(output))
        record = result.with_suffix(".jsonl")
        if record.exists():
            out["records"] = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    if rc != 0:
        out["tail"] = output[-3000:]
    return out


def pytest_summary(output: str) -> dict:
    """pytest's closing counts ('5 passed, 1 skipped in 3.2s' -> {'passed': 5, ...})."""
    lines = [line for line in output.strip().splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", line)]
    return {"counts": {k: int(n) for n, k in re.findall(r"(\d+) (\w+)", lines[-1])}} if lines else {}


def run(args: argparse.Namespace) -> int:
    args.steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in args.steps if s not in STEPS]
    if unknown:
        print(f"gpu_check: unknown step(s) {', '.join(unknown)}; the steps are {', '.join(STEPS)}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not _cuda():
        print("gpu_check: no CUDA device here; rehearse with --device cpu --quick", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    record = Record(out / "gpu_check.json", device=args.device, quick=args.quick, budget_s=args.budget_s,
                    commit=args.commit)
    with open(out / "log.txt", "w") as log, tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        for name in args.steps:
            left = args.budget_s - (time.monotonic() - start)
            need = NEEDS[name][args.device == "cpu"]
            if need > left:
                result = {"rc": None, "skipped": f"{left:.0f} s of budget left, the step needs ~{need} s"}
            else:
                result = run_step(name, args, Path(work), log, left)
            record.step(name, result)
            if name == "curve" and result.get("result"):
                _plot(result["result"], out / "curve-70b.png", record)
            state = result.get("skipped") or f"rc {result['rc']}, {result['seconds']} s"
            print(f"[{time.monotonic() - start:6.1f}s] {name}: {state}", flush=True)
    record.finish(time.monotonic() - start)
    print(json.dumps({name: brief(r) for name, r in record.data["steps"].items()}))
    return 0 if record.data["ok"] else 1


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _plot(curve: dict, path: Path, record: Record) -> None:
    from gpucheck.plot import curve_png

    try:
        if curve_png(curve, path):
            record.data["steps"]["curve"]["plot"] = path.name
    except Exception as err:  # noqa: BLE001 - the figures are in the JSON; the picture is a convenience
        record.data["steps"]["curve"]["plot"] = f"failed: {type(err).__name__}: {err}"
    record.write()


def brief(result: dict) -> dict:
    """The few figures each step is for, so the call's last line says how it went."""
    res = result.get("result") or {}
    out = {"rc": result.get("rc")}
    for key in ("gpu", "pinned_gbps", "vram_free_gb", "tokens_per_pass", "tok_s", "autoregressive_tok_s",
                "identical", "near_ties_only", "counts", "skipped"):
        if key in res or key in result:
            out[key] = res.get(key, result.get(key))
    for quant in ("int4", "bf16"):
        if quant in res:
            streamed = res[quant].get("pass_ms", {}).get("0", {})
            keys = ("copy_efficiency", "copy_peak_gbps", "error")
            out[quant] = {k: res[quant][k] for k in keys if k in res[quant]}
            ends = sorted(streamed, key=int)[:1] + sorted(streamed, key=int)[-1:]  # the smallest and largest tree
            out[quant]["pass_ms"] = {size: streamed[size] for size in ends}
    if result.get("records"):  # the tests' own lines: greedy partings and the sampling law
        out["partings"] = sum(1 for r in result["records"] if r.get("parting"))
        out["near_ties"] = sum(1 for r in result["records"] if (r.get("parting") or {}).get("near_tie"))
        out["pvalue"] = [r["pvalue"] for r in result["records"] if "pvalue" in r]
    return out


def run_one_step(args: argparse.Namespace) -> int:
    """Inside a step's own process: do it, saving its result to --result as it grows."""
    deadline = time.monotonic() + args.deadline_s

    def save(result: dict) -> None:
        tmp = args.result.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, args.result)

    if args.step == "env":
        from gpucheck.env import environment

        save(environment(args.device, quick=args.quick))
        return 0
    if args.step == "curve":
        from gpucheck.curve import run_curve

        curve = run_curve(args.device, args.quick, deadline, save)
        return 1 if any("error" in curve.get(q, {}) for q in ("int4", "bf16")) else 0
    from gpucheck.chat import run_chat

    result = run_chat(args.device, args.quick, deadline)
    save(result)
    print(json.dumps({k: result.get(k) for k in ("tokens_per_pass", "tok_s", "autoregressive_tok_s", "identical")}))
    return 0 if result["near_ties_only"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_out"))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="the rehearsal's small sizes")
    p.add_argument("--budget-s", type=float, default=470.0, help="seconds the whole check may take (default 470)")
    p.add_argument("--steps", default=",".join(STEPS))
    p.add_argument("--commit", default="", help="the commit checked (the GPU machine gets no .git)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--manifest", action="store_true", help="what would travel to the GPU machine")
    mode.add_argument("--slim", action="store_true", help="prepare this checkout for the one device call")
    mode.add_argument("--unslim", action="store_true", help="undo --slim (always, after the call)")
    mode.add_argument("--due", action="store_true", help="whether docs/gpu/ lacks a run of the current code")
    mode.add_argument("--keep", type=Path, metavar="GPU_CHECK_JSON", help="file a GPU run's result in docs/gpu/")
    mode.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--deadline-s", type=float, default=300.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        return dispatch(args)
    except (RuntimeError, ValueError, OSError, subprocess.CalledProcessError) as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 1


def dispatch(args: argparse.Namespace) -> int:
    if args.step:
        return run_one_step(args)
    if args.manifest:
        commit = travel.git(travel.REPO, "rev-parse", "--short", "HEAD").strip()
        plan = travel.manifest()
        print(travel.describe(plan, commit))
        return 0 if plan["fits"] else 1
    if args.slim:
        print(travel.slim())
        print("now: ONE device call as above, then at once: python scripts/gpu_check.py --unslim")
        return 0
    if args.unslim:
        print(travel.unslim())
        return 0
    if args.due:
        from gpucheck.record import due

        is_due, why = due()
        print(why)
        return 0 if is_due else 3
    if args.keep:
        from gpucheck.record import keep

        print("kept: " + ", ".join(str(p) for p in keep(args.keep)))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
