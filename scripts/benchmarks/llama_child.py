"""llama.cpp (llama-cpp-python) as a benchmark peer, in a child process of its own.

Why a child: on the disk tier it runs inside a memory group smaller than the model
(memlimit.py), which must hold llama.cpp alone, not the benchmark with its torch
models; and its mmapped pages and read counts (/proc/self/io) are then its own.

One child serves one GGUF file: it loads one `Llama` per (thread count, prompt
lookup on/off), since llama.cpp fixes its threads at load, and answers JSON lines:

    {"op": "load", "gguf": PATH, "threads": [1, 2], "n_ctx": N, "warm_ids": [...]}
        -> {"anon_bytes": ..., "file_bytes": ...}
    {"op": "run", "threads": 2, "lookup": false, "ids": [...], "max_new": 128,
     "temperature": 0.7, "seed": 1000, "drop_cache": true}
        -> {"tokens": [...], "seconds": ..., "passes": ..., "read_bytes": ...}
    {"op": "quit"}

Run it as `python -m benchmarks.llama_child` with scripts/ on PYTHONPATH (the
LlamaCppServer below does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.memlimit import MemoryGroup, NoMemoryGroup, group_name

SCRIPTS = Path(__file__).resolve().parent.parent
MARGIN = 8 << 20
"""Room above the child's own memory for what it allocates after warm-up. Small, since
whatever it leaves unused holds model pages too (a 50 MB margin let the 98 MB Q4_1
model stay cached whole at a 50% share); the full-length warm-up already grew every
buffer, and the kernel reclaims page cache before it fails an allocation."""


class MethodFailed(RuntimeError):
    """A method could not complete a run; the benchmark drops it from later rounds."""


def proc_read_bytes() -> int:
    """Bytes this process caused to be read from storage (O_DIRECT reads and page
    faults on mmapped files included; page cache hits not)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


# --- the child --------------------------------------------------------------------------


class _Served:
    def __init__(self, gguf: str, threads: int, lookup: bool, n_ctx: int) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding() if lookup else None  # its defaults: 2-gram, 10 tokens
        self.llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         draft_model=draft, use_mmap=True, verbose=False)
        self.eos = self.llm.token_eos()
        self.passes = 0
        evaluate = self.llm.eval

        def counting_eval(tokens):
            self.passes += 1
            return evaluate(tokens)

        self.llm.eval = counting_eval  # generate() calls self.eval once per pass

    def run(self, ids: list[int], max_new: int, temperature: float, seed: int) -> dict:
        self.llm.reset()  # a cold KV cache: generate() would otherwise reuse a matching prefix
        self.llm.set_seed(seed)
        self.passes = 0
        out: list[int] = []
        before = proc_read_bytes()
        start = time.perf_counter()
        # top_k 0 / top_p 1 / min_p 0: sample from the plain tempered distribution, like the others.
        for token in self.llm.generate(ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            out.append(int(token))
            if token == self.eos or len(out) >= max_new:
                break
        seconds = time.perf_counter() - start
        return {"tokens": out, "seconds": seconds, "passes": self.passes,
                "read_bytes": proc_read_bytes() - before}


def drop_page_cache(path: str | Path) -> None:
    """Evict the file's pages from the page cache, written back first (a fresh export's
    pages are dirty and would stay). Pages some process has mapped stay: only memory
    pressure (the group's limit) evicts those."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def serve(requests, reply) -> None:
    served: dict[tuple[int, bool], _Served] = {}
    gguf = ""
    for line in requests:
        req = json.loads(line)
        if req["op"] == "quit":
            return
        if req["op"] == "load":
            gguf = req["gguf"]
            for threads in req["threads"]:
                for lookup in (False, True):
                    served[threads, lookup] = _Served(gguf, threads, lookup, req["n_ctx"])
            # A full-length warm-up touches every buffer a run can grow into (llama-cpp-python's
            # score rows, the context's outputs), so the memory measured next is the most it needs.
            for s in served.values():
                s.run(req["warm_ids"], 4, 0.0, 0)
            reply({"anon_bytes": _rss_anon(), "file_bytes": os.path.getsize(gguf)})
        elif req["op"] == "run":
            if req.get("drop_cache"):
                drop_page_cache(gguf)
            s = served[req["threads"], req["lookup"]]
            reply(s.run(req["ids"], req["max_new"], req["temperature"], req["seed"]))


def main() -> None:
    # The protocol owns the real stdout; anything llama.cpp prints goes to stderr.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(obj: dict) -> None:
        channel.write(json.dumps(obj) + "\n")
        channel.flush()

    serve(sys.stdin, reply)


# --- the parent's side ------------------------------------------------------------------


class LlamaCppServer:
    """One child serving one GGUF, in a memory group on the disk tier.

    memory_share: on the disk tier, how much of the model file the group may keep in
    the page cache (its limit = the child's own memory after warm-up + MARGIN + this
    share of the file); None runs without a group (the RAM tier).
    """

    def __init__(self, gguf: Path, *, threads: list[int], n_ctx: int, warm_ids: list[int],
                 memory_share: float | None, tag: str, notes: list[str]) -> None:
        self.gguf = gguf
        self.disk = memory_share is not None
        """Disk tier: each run starts with the model out of the page cache."""
        self.group: MemoryGroup | None = None
        self.floor = 0
        self.limit = 0
        self.own_bytes = 0
        self.log = tempfile.NamedTemporaryFile(prefix="llama-child-", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")])))
        self.child = subprocess.Popen([sys.executable, "-m", "benchmarks.llama_child"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        if memory_share is not None:
            # A page already in the page cache stays charged to whoever read (or wrote) it
            # first, outside the group and beyond its limit: the child must fault every page
            # in itself.
            drop_page_cache(gguf)
            try:
                self.group = MemoryGroup.create(group_name(tag))
                self.group.add(self.child.pid)  # before the load: every page it maps is charged here
            except (NoMemoryGroup, OSError) as err:
                self.group = None
                notes.append(f"llama.cpp ({gguf.name}) ran WITHOUT a memory limit: {err}. It keeps the whole "
                             f"model in the page cache after its first pass, so its figures are RAM-tier speeds, "
                             f"not disk-tier ones.")
        loaded = self._ask({"op": "load", "gguf": str(gguf), "threads": threads, "n_ctx": n_ctx,
                            "warm_ids": warm_ids})
        self.file_bytes = loaded["file_bytes"]
        self.own_bytes = loaded["anon_bytes"]
        if self.group is not None:
            self.floor = self.own_bytes + MARGIN
            self.limit = self.floor + int(memory_share * self.file_bytes)
            self.group.set_limit(self.limit)
            notes.append(f"llama.cpp ({gguf.name}) ran in memory group {self.group.path} limited to "
                         f"{self.limit / 1e6:.0f} MB: its own anonymous memory after warm-up "
                         f"({self.own_bytes / 1e6:.0f} MB) + {MARGIN / 1e6:.0f} MB + room for {memory_share:.0%} of "
                         f"the {self.file_bytes / 1e6:.0f} MB model's pages, so most weights are read from disk "
                         f"again each pass (the group is removed after)")

    def describe(self) -> dict:
        """For the JSON line: the file, and the memory group's limit (None: no limit)."""
        return {"gguf": str(self.gguf), "file_bytes": self.file_bytes, "own_bytes": self.own_bytes,
                "memory_limit_bytes": self.limit if self.group is not None else None,
                "page_cache_dropped_per_run": self.disk}

    def _ask(self, request: dict) -> dict:
        if self.child.poll() is None:
            try:
                self.child.stdin.write(json.dumps(request) + "\n")
                self.child.stdin.flush()
                line = self.child.stdout.readline()
                if line:
                    return json.loads(line)
            except (BrokenPipeError, OSError):
                pass
        self.child.wait(timeout=10)
        oom = self.group is not None and self.group.oom_killed()
        why = (f"killed by the memory limit ({self.limit / 1e6:.0f} MB): raise --llama-cpp-cache-share" if oom
               else f"exit status {self.child.returncode}")
        tail = Path(self.log.name).read_text(errors="replace")[-800:]
        raise MethodFailed(f"the llama.cpp child for {self.gguf.name} died ({why}). Its log ends: {tail}")

    def run(self, threads: int, lookup: bool, ids: list[int], max_new: int, temperature: float,
            seed: int) -> dict:
        if self.group is not None:
            # Start cold, as every other disk-tier method does: squeeze the group down to the
            # child's own memory (the kernel evicts its cached weight pages), then let it grow.
            try:
                self.group.set_limit(self.floor)
            except OSError:
                pass  # could not reclaim to the floor: it starts a little warm
            self.group.set_limit(self.limit)
        return self._ask({"op": "run", "threads": threads, "lookup": lookup, "ids": ids, "max_new": max_new,
                          "temperature": temperature, "seed": seed, "drop_cache": self.disk})

    def close(self, notes: list[str]) -> None:
        if self.child.poll() is None:
            try:
                self.child.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.child.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
        if self.group is not None:
            try:
                self.group.remove()
            except OSError as err:
                notes.append(f"could not remove the memory group {self.group.path}: {err}; remove it with "
                             f"`rmdir {self.group.path}`")
        Path(self.log.name).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
