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

Or it decodes N sequences in one llama.cpp batch (bench_batch.py's peer,
LlamaCppBatchServer): its load asks for `"op": "load_batch", "sequences": N` and

    {"op": "run_batch", "prompts": [[...], ...], "max_new": 128, "temperature": 0.7,
     "seed": 1000, "eos_ids": [2], "drop_cache": true}
        -> {"tokens": [[...], ...], "first": [s, ...], "done": [s, ...], "seconds": ...,
            "passes": ..., "read_bytes": ...}   (or {"error": "..."})

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

import numpy as np

from benchmarks.memlimit import MemoryGroup, NoMemoryGroup, group_name

SCRIPTS = Path(__file__).resolve().parent.parent
MARGIN = 8 << 20
"""Room above the child's own memory for what it allocates after warm-up. Small, since
whatever it leaves unused holds model pages too (a 50 MB margin let the 98 MB Q4_1
model stay cached whole at a 50% share); the full-length warm-up already grew every
buffer, and the kernel reclaims page cache before it fails an allocation."""


class MethodFailed(RuntimeError):
    """A method could not complete a run; the benchmark drops it from later rounds."""


def proc_io_bytes(field: str = "read_bytes") -> int:
    """Bytes this process caused to be read from storage (O_DIRECT reads and page
    faults on mmapped files included; page cache hits not), or with "write_bytes",
    written to it."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith(f"{field}:"):
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
        before = proc_io_bytes()
        start = time.perf_counter()
        # top_k 0 / top_p 1 / min_p 0: sample from the plain tempered distribution, like the others.
        for token in self.llm.generate(ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            out.append(int(token))
            if token == self.eos or len(out) >= max_new:
                break
        seconds = time.perf_counter() - start
        return {"tokens": out, "seconds": seconds, "passes": self.passes,
                "read_bytes": proc_io_bytes() - before}


class _BatchServed:
    """N sequences decoded together with llama.cpp's batch API: the prompts in one batch
    (n_batch tokens per llama_decode), then one llama_decode per step holding one token
    of every sequence still running. seq_id = the request's index; each sequence has a
    KV stream of its own (kv_unified off), so a row attends to its own n_ctx cells only,
    as it would alone."""

    def __init__(self, gguf: str, *, threads: int, n_ctx: int, sequences: int) -> None:
        import llama_cpp as lib

        lib.llama_backend_init()
        self.lib = lib
        mparams = lib.llama_model_default_params()
        mparams.use_mmap = True
        self.model = lib.llama_model_load_from_file(gguf.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab_size = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model)))
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx * sequences
        cparams.n_batch = cparams.n_ubatch = min(512, n_ctx * sequences)
        cparams.n_seq_max = sequences
        cparams.kv_unified = False
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {sequences} x {n_ctx} tokens")
        self.n_ctx = int(lib.llama_n_ctx_seq(self.ctx))
        self.sequences = sequences
        self.mem = lib.llama_get_memory(self.ctx)
        self.n_batch = int(lib.llama_n_batch(self.ctx))
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self.passes = 0

    def warm_up(self, ids: list[int]) -> None:
        """Every sequence at once (full prompt chunks: the largest compute buffer), then the
        KV cache cleared with its data, which writes every page of it: the memory measured
        next is the most a run needs."""
        self.run([ids] * self.sequences, 4, 0.0, 0, [])
        self.lib.llama_memory_clear(self.mem, True)

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[int], outputs: list[bool]) -> np.ndarray:
        """Logits ([rows, vocab]) of the tokens marked in `outputs`, in order."""
        lib, batch = self.lib, self.batch
        out = np.empty((sum(outputs), self.vocab_size), dtype=np.float32)
        row = 0
        for start in range(0, len(tokens), self.n_batch):
            end = min(start + self.n_batch, len(tokens))
            batch.n_tokens = end - start
            for j, i in enumerate(range(start, end)):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = tokens[i], positions[i], 1
                batch.seq_id[j][0], batch.logits[j] = seqs[i], outputs[i]
            status = lib.llama_decode(self.ctx, batch)
            if status != 0:
                raise RuntimeError(f"llama_decode failed with status {status} ({end - start} tokens)")
            self.passes += 1
            for j, i in enumerate(range(start, end)):
                if outputs[i]:
                    out[row] = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, j), shape=(self.vocab_size,))
                    row += 1
        return out

    def run(self, prompts: list[list[int]], max_new: int, temperature: float, seed: int,
            eos_ids: list[int]) -> dict:
        if len(prompts) > self.sequences:
            raise ValueError(f"{len(prompts)} prompts for a context of {self.sequences} sequences")
        longest = max(map(len, prompts)) + max_new
        if longest > self.n_ctx:
            raise ValueError(f"a prompt and its reply need {longest} cells, a sequence has {self.n_ctx}")
        self.lib.llama_memory_clear(self.mem, False)  # cold: every request is a new conversation
        rng = np.random.default_rng(seed)
        eos = set(eos_ids)
        self.passes = 0
        before = proc_io_bytes()
        start = time.perf_counter()
        flat = [(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
        logits = self._decode(*map(list, zip(*flat)))
        out: list[list[int]] = [[] for _ in prompts]
        first: list[float] = [0.0] * len(prompts)
        done: list[float] = [0.0] * len(prompts)
        running = list(range(len(prompts)))
        while running:
            picked = [_pick(row, temperature, rng) for row in logits]
            now = time.perf_counter() - start
            still = []
            for s, token in zip(running, picked):
                out[s].append(token)
                if len(out[s]) == 1:
                    first[s] = now
                if token in eos or len(out[s]) >= max_new:
                    done[s] = now
                else:
                    still.append(s)
            running = still
            if running:
                logits = self._decode([out[s][-1] for s in running],
                                      [len(prompts[s]) + len(out[s]) - 1 for s in running], running,
                                      [True] * len(running))
        return {"tokens": out, "first": first, "done": done, "seconds": time.perf_counter() - start,
                "passes": self.passes, "read_bytes": proc_io_bytes() - before}


def _pick(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """argmax, or a draw from softmax(logits / temperature) (no top-k, top-p or min-p)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    cdf = np.cumsum(np.exp(z - z.max()))
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))


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
    batch: _BatchServed | None = None
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
        elif req["op"] == "load_batch":
            gguf = req["gguf"]
            batch = _BatchServed(gguf, threads=req["threads"][0], n_ctx=req["n_ctx"], sequences=req["sequences"])
            batch.warm_up(req["warm_ids"])
            reply({"anon_bytes": _rss_anon(), "file_bytes": os.path.getsize(gguf)})
        elif req["op"] == "run_batch":
            if req.get("drop_cache"):
                drop_page_cache(gguf)
            try:
                reply(batch.run(req["prompts"], req["max_new"], req["temperature"], req["seed"], req["eos_ids"]))
            except (RuntimeError, ValueError) as err:  # a prompt too long, a failed pass: the parent says which
                reply({"error": str(err)})


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

    def _start_cold(self) -> None:
        """As every other disk-tier method starts: squeeze the group down to the child's own
        memory (the kernel evicts its cached weight pages), then let it grow."""
        if self.group is not None:
            try:
                self.group.set_limit(self.floor)
            except OSError:
                pass  # could not reclaim to the floor: it starts a little warm
            self.group.set_limit(self.limit)

    def run(self, threads: int, lookup: bool, ids: list[int], max_new: int, temperature: float,
            seed: int) -> dict:
        self._start_cold()
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


class LlamaCppBatchServer(LlamaCppServer):
    """One child decoding up to `sequences` requests in one llama.cpp batch (bench_batch.py's
    peer), in a memory group on the disk tier as LlamaCppServer's is. n_ctx: cells per
    sequence; threads: llama.cpp's, fixed at load."""

    def __init__(self, gguf: Path, *, threads: int, sequences: int, n_ctx: int, warm_ids: list[int],
                 memory_share: float | None, tag: str, notes: list[str]) -> None:
        self._load_fields = {"op": "load_batch", "sequences": sequences}
        super().__init__(gguf, threads=[threads], n_ctx=n_ctx, warm_ids=warm_ids, memory_share=memory_share,
                         tag=tag, notes=notes)

    def _ask(self, request: dict) -> dict:
        if request["op"] == "load":  # LlamaCppServer's load, made a batch child's
            request = {**request, **self._load_fields}
        return super()._ask(request)

    def run_batch(self, prompts: list[list[int]], max_new: int, temperature: float, seed: int,
                  eos_ids: list[int]) -> dict:
        """Per request its tokens and the seconds to its first and last token; the child's
        own wall time ("seconds") and passes. Raises MethodFailed if the child failed."""
        self._start_cold()
        out = self._ask({"op": "run_batch", "prompts": prompts, "max_new": max_new, "temperature": temperature,
                         "seed": seed, "eos_ids": eos_ids, "drop_cache": self.disk})
        if "error" in out:
            raise MethodFailed(f"llama.cpp batch on {self.gguf.name}: {out['error']}")
        return out


if __name__ == "__main__":
    main()
