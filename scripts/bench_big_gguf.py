#!/usr/bin/env python
"""The model the product exists for: an 8B-shaped Q4_K_M GGUF that does not fit in memory,
against llama.cpp on the same file and the same memory.

    python scripts/bench_big_gguf.py                  # limits 2.5, 3.5, 5 GB and none
    python scripts/bench_big_gguf.py --quick          # 3.5 GB and none, fewer tokens

The target is built from the shipped SmolLM2-135M-Instruct (benchmarks/padded_gguf.py:
dequantized, zero-padded into Llama-3-8B's shape and quantized by llama.cpp to Q4_K_M,
4.35 GB): it answers as SmolLM2 does, with an 8B's bytes and FLOPs. Each method runs in a
child process of its own, inside a cgroup v1 memory group with the limit (a group with no
limit for the "no limit" runs, for the peak), after the file's pages were dropped from the page cache; 2 threads,
the same context size, greedy:
  ours              the engine as a newcomer runs it (`--target`: plan fitted to the
                    group's memory), the shipped SmolLM2 Q4_1 + n-gram as minions
  ours weak         the same with SmolLM2 re-quantized to Q2_K as the minion
  ours alone        the same target with trees off (autoregressive)
  llama.cpp         `llama-completion` (mmap; under a limit with --no-repack: its default
                    copies the Q4_K weights into a 3.2 GB buffer and is killed)
  llama.cpp spec    `llama-speculative-simple` with the same SmolLM2 Q4_1 draft
Also: the raw O_DIRECT read speed of the file, the time of a 40-node tree pass against
llama.cpp's 1-token time, and the physical bound of a pass (max of the streamed layers'
bytes over that speed and the pass's compute at its rows, measured without a limit). On a
VM the host's cache can serve the streamed layers' re-reads faster than a cold O_DIRECT
read (8B at 3.5 GB: the chats' reads ran at ~2.7 GB/s where O_DIRECT gave 1.15), so
there the ratio to the bound can pass 1.
Prints a table per limit and ends with one JSON line; --png plots tok/s against the limit.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.chat_prompts import CHAT_PROMPTS
from benchmarks.llama_child import drop_page_cache
from benchmarks.llama_tools import ToolRun, completion, speculative, tools_dir
from benchmarks.memlimit import MemoryGroup, NoMemoryGroup, group_name
from benchmarks.padded_gguf import padded_gguf, source_gguf

SCRIPTS = Path(__file__).resolve().parent
GB = 1e9


def box() -> dict:
    """The CPU (lscpu's model name and its widest vector extension) and its cores."""
    model = ""
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            model = line.split(":", 1)[1].strip()
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    kind = "AMX" if " amx_tile" in flags else "AVX-512" if " avx512f" in flags else "AVX2"
    return {"cpu": model, "class": kind, "cores": os.cpu_count()}


def raw_read_gbps(path: Path, streams: int, nbytes: int = 2 << 30, chunk: int = 16 << 20) -> float:
    """O_DIRECT read speed of the file's first `nbytes` in `streams` parallel sequential
    readers (the page cache dropped): a virtual disk serves several requests at once
    faster than one, as readahead has them in flight."""
    import threading

    drop_page_cache(path)
    per = nbytes // streams // chunk * chunk

    def read(offset: int) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, chunk)
        try:
            done = 0
            while done < per:
                n = os.preadv(fd, [buf], offset + done)
                if n <= 0:
                    break
                done += n
        finally:
            os.close(fd)
            buf.close()

    readers = [threading.Thread(target=read, args=(i * per,)) for i in range(streams)]
    start = time.perf_counter()
    for r in readers:
        r.start()
    for r in readers:
        r.join()
    return streams * per / (time.perf_counter() - start) / GB


def weak_draft(source: Path) -> Path:
    """SmolLM2 re-quantized to Q2_K by llama.cpp (cached beside the padded files)."""
    from benchmarks.padded_gguf import cache_dir
    from minions_local.backends.substitute import substitute_gguf

    return substitute_gguf(source, "q2_k", cache_dir() / "smollm2-135m-instruct.q2_k.gguf", name="q2_k")


def chats(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": text}] for _, text in CHAT_PROMPTS[:count]]


def rendered(draft: Path, messages: list[dict]) -> str:
    """The chat prompt as llama.cpp's programs read it (the file's own template)."""
    import llama_cpp

    from minions_local.backends.llama_context import import_llama_cpp
    from minions_local.backends.llama_vocab import LlamaVocab

    lib = import_llama_cpp()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(str(draft).encode(), params)
    try:
        return LlamaVocab(llama_cpp, model).apply_chat_template(messages)
    finally:
        lib.llama_model_free(model)


def warm_host_memory(nbytes: int) -> None:
    """Touch `nbytes` of fresh memory in a child and let it go, so that the next run's first
    touch of that much memory meets pages the host backs.

    Why: this VM's host backs guest memory lazily and takes back what the guest frees
    after a few idle seconds, so a process that first touches gigabytes pays ~1-2 s a GB in
    faults that a laptop does not (llama.cpp's load of the 8B: 4.5-6.1 s right after a
    5 GiB touch, 7.3-11.8 s after 20 s idle; 2-core AVX-512 EPYC, 2026-12-02). Without it
    the run after a pause paid that alone: ours, first in each memory condition."""
    subprocess.run([sys.executable, "-c", f"b'\\1' * {int(nbytes)}"], check=False)


class Limit:
    """One memory condition: a fresh memory group per run (None: no limit), entered after a
    touch of the files' size and a gigabyte more (warm_host_memory) and with the files'
    pages dropped from the page cache."""

    def __init__(self, gigabytes: float, files: list[Path]) -> None:
        self.gigabytes, self.files = gigabytes, files
        self.peak = 0

    def __enter__(self) -> MemoryGroup | None:
        warm_host_memory(sum(f.stat().st_size for f in self.files) + int(GB))
        for f in self.files:
            drop_page_cache(f)
        self.group = None
        try:  # a group without a limit too: its peak is the run's memory (the file's pages included)
            self.group = MemoryGroup.create(group_name("bigguf"))
        except NoMemoryGroup:
            if self.gigabytes:
                raise
        if self.gigabytes:
            self.group.set_limit(int(self.gigabytes * GB))
        return self.group

    def __exit__(self, *exc) -> None:
        if self.group is not None:
            self.peak = self.group._read_int("memory.max_usage_in_bytes")
            self.group.remove()


def ours(target: Path, minions: list[str], conversations: list, max_new: int, limit: Limit,
         tree_pass: int = 0, kernel: str = "auto", extra_args: list[str] = (), context: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        prompts, out = Path(tmp) / "prompts.json", Path(tmp) / "out.json"
        prompts.write_text(json.dumps(conversations))
        argv = [sys.executable, "-m", "benchmarks.engine_child", "--target", str(target), "--minions",
                ",".join(minions), "--prompts", str(prompts), "--max-new", str(max_new), "--out", str(out),
                "--tree-pass", str(tree_pass), "--kernel", kernel, "--context", str(context), *extra_args]
        # A cache of its own: every run loads the file as new (its exactness check runs,
        # and is the cost model's timing), which is the load a newcomer's first chat pays.
        cache = Path(tmp) / "cache"
        env = {**os.environ, "PYTHONPATH": str(SCRIPTS), "MINIONS_CACHE_DIR": str(cache)}
        with limit as group:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, errors="replace",
                                  preexec_fn=(lambda: group.add(0)) if group is not None else None)
        if proc.returncode != 0:
            return {"error": (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]}
        result = json.loads(out.read_text())
    result["peak_group"] = limit.peak
    tokens = sum(len(c["tokens"]) for c in result["chats"])
    decode = sum(c["seconds"] - c["ttft"] for c in result["chats"])
    passes = sum(c["passes"] for c in result["chats"])
    sizes = [t for c in result["chats"] for t in c["tree_sizes"]]
    result.update(tok_s=tokens / decode if decode else 0.0, tokens_per_pass=tokens / passes if passes else 0.0,
                  step_seconds=decode / passes if passes else 0.0, tree_median=statistics.median(sizes) if sizes else 0,
                  ttft=statistics.median(c["ttft"] for c in result["chats"]),
                  streamed_per_pass=result["bytes_streamed"] / passes if passes else 0)
    return result


def tool(run: ToolRun, limit: Limit) -> dict:
    if run.error:
        return {"error": run.error}
    return {"tok_s": run.tok_s, "tokens": run.tokens, "ttft": run.prompt_seconds, "load_seconds": run.load_seconds,
            "ready_seconds": run.ready_seconds, "peak_group": limit.peak,
            "tokens_per_pass": run.tokens / max(run.tokens - run.accepted, 1) if run.drafted else 1.0,
            "accept": run.accepted / run.drafted if run.drafted else None}


def run_limit(gb: float, files: dict, args, tools: Path) -> dict:
    """Every method under one memory limit."""
    convs = chats(args.prompts)
    text = [rendered(files["draft"], c) for c in convs]
    limit = lambda: Limit(gb, [files["target"], files["draft"]])  # noqa: E731
    limited = bool(gb)
    out = {}
    want = set(args.methods.split(","))
    if "ours" in want:
        out["ours"] = ours(files["target"], [str(files["draft"]), "ngram"], convs, args.max_new, limit(), tree_pass=40,
                           context=args.ctx)
    if "ours weak" in want:
        out["ours weak"] = ours(files["target"], [str(files["weak"]), "ngram"], convs[:1], args.max_new, limit(),
                                context=args.ctx)
    if "ours alone" in want:
        out["ours alone"] = ours(files["target"], [], convs[:1], args.alone_tokens, limit(), tree_pass=0,
                                 context=args.ctx)
    if "ours torch" in want:  # the torch path (the file's weights dequantized into float32 as each layer runs)
        out["ours torch"] = ours(files["target"], [str(files["draft"]), "ngram"], convs[:1], args.max_new, limit(),
                                 kernel="dequant", context=args.ctx)
    if "llama.cpp" in want:
        lim = limit()
        with lim as group:  # as many tokens as ours without a limit, where it is quick
            plain = completion(tools, files["target"], text[0], max_new=args.alone_tokens if limited else args.max_new,
                               threads=args.threads, ctx=args.ctx, repack=not limited, group=group)
        out["llama.cpp"] = tool(plain, lim)
    best: dict = {}
    for draft_max in args.draft_max if "llama.cpp spec" in want else ():  # its default, and a longer draft
        lim = limit()
        with lim as group:
            spec = speculative(tools, files["target"], files["draft"], text[0], max_new=args.max_new,
                               threads=args.threads, ctx=args.ctx, repack=not limited, group=group,
                               draft_max=draft_max)
        run = {**tool(spec, lim), "draft_max": draft_max or 3}
        if run.get("tok_s", 0) >= best.get("tok_s", 0):
            best = run
    if best:
        out["llama.cpp spec"] = best
    return out


def identical(a: dict, b: dict) -> bool | None:
    """Greedy replies of two of our runs agree on every token both produced."""
    if "chats" not in a or "chats" not in b:
        return None
    pairs = list(zip(a["chats"], b["chats"]))
    return all(x["tokens"][:min(len(x["tokens"]), len(y["tokens"]))] == y["tokens"][:len(x["tokens"])]
               or y["tokens"][:len(x["tokens"])] == x["tokens"][:len(y["tokens"])] for x, y in pairs)


def ratio(a: dict, b: dict) -> float | None:
    return a["tok_s"] / b["tok_s"] if a.get("tok_s") and b.get("tok_s") else None


def load_ratio(ours_run: dict, peer: dict, peer_key: str = "load_seconds") -> float | None:
    """Our load (start to ready) over the peer's `peer_key`."""
    return ours_run["load_seconds"] / peer[peer_key] if ours_run.get("load_seconds") and peer.get(peer_key) else None


def report(results: dict, raw: float, args) -> dict:
    main = next((k for k in results if k == args.main), next(iter(results)))
    ram = results.get(0.0, {})
    summary: dict = {}
    for gb, runs in results.items():
        print(f"\n== {'no limit' if not gb else f'memory limit {gb:.1f} GB'} ==")
        print(f"{'method':<16}{'tok/s':>8}{'tok/pass':>10}{'ttft s':>8}{'load s':>8}{'peak GB':>9}  notes")
        for name, r in runs.items():
            if "error" in r:
                print(f"{name:<16}{'-':>8}{'':>10}{'':>8}{'':>8}{'':>9}  {r['error']}")
                continue
            note = f"accept {r['accept']:.0%}, draft max {r['draft_max']}" if r.get("accept") is not None else ""
            if "step_seconds" in r:  # the trees the policy chose, and what a step cost: why a run's tok/s moved
                note += f"trees of {r['tree_median']:g} nodes (median), {r['step_seconds']:.2f} s a step; "
            if r.get("tree_pass_seconds"):
                note += f"40-node tree pass {r['tree_pass_seconds']:.2f} s, 1 row {r['one_row_seconds']:.2f} s"
            if r.get("ready_seconds"):  # 'load s' is its weights' load line
                note += f"{', ' if note else ''}ready to read the prompt after {r['ready_seconds']:.1f} s"
            print(f"{name:<16}{r['tok_s']:>8.2f}{r['tokens_per_pass']:>10.2f}{r['ttft']:>8.1f}"
                  f"{r.get('load_seconds', 0):>8.1f}{r.get('peak_group', 0) / GB:>9.2f}  {note}")
    runs = results[main]
    o, plain = runs.get("ours", {}), runs.get("llama.cpp", {})
    bound = None
    if o.get("tokens_per_pass") and ram.get("ours", {}).get("tree_pass_seconds"):
        # the streamed layers' bytes a pass (what must be read), and the pass's compute at its
        # mean rows, on the line through the 1-row and 41-row passes measured without a limit
        read_s = o["bytes_streamed"] / sum(c["passes"] for c in o["chats"]) / (raw * GB)
        rows = statistics.mean(t + 1 for c in o["chats"] for t in c["tree_sizes"])
        one, tree = ram["ours"]["one_row_seconds"], ram["ours"]["tree_pass_seconds"]
        compute_s = one + (tree - one) / 40 * (rows - 1)
        bound = o["tokens_per_pass"] / max(read_s, compute_s)
    summary.update({
        "main_limit_gb": main, "raw_read_gbps": round(raw, 2),
        "vs_llama_cpp": ratio(o, plain), "vs_ours_alone": ratio(o, runs.get("ours alone", {})),
        "vs_llama_cpp_spec": ratio(o, runs.get("llama.cpp spec", {})),
        "weak_vs_llama_cpp": ratio(runs.get("ours weak", {}), plain),
        "weak_tokens_per_pass": runs.get("ours weak", {}).get("tokens_per_pass"),
        "tree_pass_vs_llama_token": (o["tree_pass_seconds"] * plain["tok_s"]
                                     if o.get("tree_pass_seconds") and plain.get("tok_s") else None),
        "of_physical_bound": o["tok_s"] / bound if bound else None,
        "ram_vs_llama_cpp": ratio(ram.get("ours", {}), ram.get("llama.cpp", {})) if ram else None,
        "ram_vs_llama_cpp_spec": ratio(ram.get("ours", {}), ram.get("llama.cpp spec", {})) if ram else None,
        "tokens_per_pass": o.get("tokens_per_pass"),
        "load_vs_llama_cpp": load_ratio(o, plain),
        # Held in RAM, llama.cpp's load copies its Q4_K matrices as ours does; its 'ready'
        # (start to prompt: the context's buffers and warm-up too) is the same span as our
        # load, which is measured from the engine's imports to its ready minions.
        "ram_load_vs_llama_cpp": load_ratio(ram.get("ours", {}), ram.get("llama.cpp", {})) if ram else None,
        "ram_load_vs_llama_cpp_ready": load_ratio(ram.get("ours", {}), ram.get("llama.cpp", {}), "ready_seconds")
        if ram else None,
        "disk_written_mb": o.get("disk_written", 0) / 1e6,
        "greedy_identical": all(identical(r.get("ours", {}), r.get("ours alone", {})) is not False
                                and identical(r.get("ours weak", {}), r.get("ours alone", {})) is not False
                                for r in results.values()),
    })
    print("\n" + "\n".join(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}" for k, v in summary.items()))
    return summary


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limits = sorted(results, key=lambda g: g or 1e9)
    labels = [f"{g:.1f} GB" if g else "no limit" for g in limits]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("ours", "ours weak", "ours alone", "ours torch", "llama.cpp", "llama.cpp spec"):
        if not any(name in results[g] for g in limits):
            continue
        ax.plot(labels, [results[g].get(name, {}).get("tok_s", float("nan")) for g in limits], marker="o", label=name)
    ax.set_ylabel("tokens / s (decode)")
    ax.set_xlabel("memory limit (8B-shaped Q4_K_M, 4.35 GB file)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3.5 GB and no limit; 2 chats of 48 tokens")
    parser.add_argument("--limits", default="2.5,3.5,5,0", help="GB, comma-separated; 0 = no limit")
    parser.add_argument("--main", type=float, default=3.5, help="the limit the ratios are stated at")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--alone-tokens", type=int, default=24, help="tokens for the 1-token-a-pass methods")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--methods", default="ours,ours weak,ours alone,llama.cpp,llama.cpp spec",
                        help="comma-separated; 'ours torch' adds our torch GGUF path (gguf_kernel = 'dequant')")
    args = parser.parse_args()
    args.draft_max = [None, 16]
    if args.quick:
        args.limits, args.prompts, args.max_new, args.alone_tokens, args.draft_max = "3.5,0", 2, 48, 16, [None]
    info = box()
    print(f"box: {info['cpu']} ({info['class']}), {info['cores']} cores")
    files = {"target": padded_gguf("8b", "q4_k_m"), "draft": source_gguf()}
    files["weak"] = weak_draft(files["draft"])
    one, raw = raw_read_gbps(files["target"], 1), raw_read_gbps(files["target"], 8)
    print(f"target {files['target'].name}: {files['target'].stat().st_size / GB:.2f} GB, raw O_DIRECT read "
          f"{one:.2f} GB/s (1 reader), {raw:.2f} GB/s (8 readers: the bound uses this)")
    print(f"conditions: {args.threads} threads for llama.cpp's tools, {min(os.cpu_count() or 1, 8)} for ours (its "
          f"default: the cores, at most 8); a context of {args.ctx} tokens each; greedy; the page cache dropped "
          f"before each run, each in a memory group of its own")
    tools = tools_dir()
    results = {}
    for gb in [float(x) for x in args.limits.split(",")]:
        try:
            results[gb] = run_limit(gb, files, args, tools)
        except NoMemoryGroup as err:
            print(f"no memory group ({err}): the {gb} GB runs are skipped")
    summary = report(results, raw, args)
    if args.png:
        plot(results, args.png)
    print(json.dumps({"bench": "big_gguf", **info, **{k: (round(v, 3) if isinstance(v, float) else v)
                                                       for k, v in summary.items()},
                      "tok_s": {f"{g:g}": {n: round(r.get("tok_s", 0), 3) for n, r in runs.items()}
                                for g, runs in results.items()}}))


if __name__ == "__main__":
    main()
