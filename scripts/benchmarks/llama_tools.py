"""llama.cpp's own command-line programs as benchmark peers: `llama-completion` (plain
decoding) and `llama-speculative-simple` (its speculative decoding with a draft model),
built once by scripts/build_llama_cpp_tools.sh from the source llama-cpp-python vendors.

Each run is a child process, optionally inside a memory group (memlimit.py); what it
printed is parsed into a `ToolRun`. Greedy (`--temp 0`), `-t` threads, the prompt from a
file (already in the model's chat format), no conversation mode.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.memlimit import MemoryGroup

SCRIPTS = Path(__file__).resolve().parent.parent
_EVAL = re.compile(r"\beval time =\s*([0-9.]+) ms /\s*(\d+) runs")
_PROMPT = re.compile(r"prompt eval time =\s*([0-9.]+) ms /\s*(\d+) tokens")
_LOAD = re.compile(r"load time =\s*([0-9.]+) ms")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([0-9.]+) seconds")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")


@dataclass
class ToolRun:
    """What one llama.cpp program run printed: decode speed, prompt time, load time."""

    tokens: int = 0
    decode_seconds: float = 0.0
    prompt_seconds: float = 0.0
    load_seconds: float = 0.0
    wall_seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    peak_bytes: int = 0
    error: str = ""
    text: str = field(default="", repr=False)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def ready_seconds(self) -> float:
        """From the program's start until it could read the prompt: its wall time less the
        prompt's and the decode's (so its load, its context's buffers and its warm-up
        pass, and its exit). Its 'load time' line counts the weights' load alone."""
        return max(0.0, self.wall_seconds - self.prompt_seconds - self.decode_seconds)


def tools_dir() -> Path:
    """Where build_llama_cpp_tools.sh keeps the programs (built there if missing)."""
    script = SCRIPTS / "build_llama_cpp_tools.sh"
    folder = Path(subprocess.run(["bash", str(script), "--print-dir"], capture_output=True, text=True,
                                 check=True).stdout.strip())
    if not (folder / "llama-speculative-simple").is_file():
        subprocess.run(["bash", str(script)], check=True)
    return folder


def run_tool(argv: list[str], group: MemoryGroup | None, timeout: float) -> tuple[str, float, str]:
    """Run a program (in `group` when given); its output, wall time and an error ('' if none)."""
    start = time.perf_counter()
    # llama.cpp's own settings: not the kernel switches our target sets in this process
    # (llama_context.import_llama_cpp), which its children would inherit.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_CPU_TILED_MM")}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout, env=env,
                              preexec_fn=(lambda: group.add(0)) if group is not None else None)
    except subprocess.TimeoutExpired:
        return "", time.perf_counter() - start, f"no result in {timeout:.0f} s"
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        killed = group is not None and group.oom_killed()
        why = "killed for memory" if killed or proc.returncode in (-9, 137) else f"exit status {proc.returncode}"
        return proc.stdout + proc.stderr, wall, why
    return proc.stdout + proc.stderr, wall, ""


def completion(tools: Path, model: Path, prompt: str, *, max_new: int, threads: int, ctx: int,
               repack: bool, group: MemoryGroup | None, timeout: float = 3600, extra: list[str] = ()) -> ToolRun:
    """llama.cpp plain: `llama-completion`, greedy; `extra`: more of its options (e.g. --rpc)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt)
        f.flush()
        argv = [str(tools / "llama-completion"), "-m", str(model), "-f", f.name, "-n", str(max_new), "-t",
                str(threads), "-c", str(ctx), "--temp", "0", "-no-cnv", "--no-display-prompt"]
        out, wall, error = run_tool(argv + ([] if repack else ["-nr"]) + list(extra), group, timeout)
    run = ToolRun(wall_seconds=wall, error=error, text=out)
    if (m := _EVAL.findall(out)):
        ms, runs = m[-1]
        run.decode_seconds, run.tokens = float(ms) / 1000, int(runs)
    if (m := _PROMPT.search(out)):
        run.prompt_seconds = float(m.group(1)) / 1000
    if (m := _LOAD.search(out)):
        run.load_seconds = float(m.group(1)) / 1000
    if not run.tokens and not run.error:
        run.error = "printed no timings"
    return run


def speculative(tools: Path, model: Path, draft: Path, prompt: str, *, max_new: int, threads: int, ctx: int,
                repack: bool, group: MemoryGroup | None, draft_max: int | None = None,
                timeout: float = 3600, extra: list[str] = ()) -> ToolRun:
    """llama.cpp's speculative decoding: `llama-speculative-simple` with `draft`, greedy;
    `draft_max`: its most draft tokens a pass (None: its default, 3); `extra`: more options."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt)
        f.flush()
        argv = [str(tools / "llama-speculative-simple"), "-m", str(model), "-md", str(draft), "--spec-type",
                "draft-simple", "-f", f.name, "-n", str(max_new), "-t", str(threads), "-c", str(ctx), "--temp", "0"]
        if draft_max is not None:
            argv += ["--spec-draft-n-max", str(draft_max)]
        out, wall, error = run_tool(argv + ([] if repack else ["-nr"]) + list(extra), group, timeout)
    run = ToolRun(wall_seconds=wall, error=error, text=out)
    if (m := _DECODED.search(out)):
        run.tokens, run.decode_seconds = int(m.group(1)), float(m.group(2))
    if (m := _ENCODED.search(out)):
        run.prompt_seconds = float(m.group(2))
    run.drafted = int(_DRAFTED.search(out).group(1)) if _DRAFTED.search(out) else 0
    run.accepted = int(_ACCEPTED.search(out).group(1)) if _ACCEPTED.search(out) else 0
    if not run.tokens and not run.error:
        run.error = "printed no timings"
    return run
