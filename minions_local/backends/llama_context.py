"""llama.cpp itself, for the GGUF minion (backends/gguf.py): loading the library, and
contexts that several requests share.

llama.cpp runs one batch per context, and every token of a batch names the sequences
it belongs to: it attends only to cells of those sequences. So requests that share a
context can share its passes: each request owns a block of sequence ids (its prefix
sequence, then its tree sequences), and one llama_decode runs the frontier nodes of
every request in the context.

What a context costs: its KV cache holds `cells` tokens for each request it can
hold, while the logits rows (one per sequence id) and the compute buffer are paid
once per context, however many requests share it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minions_local.backends.llama_build import build_problem
from minions_local.core.errors import ModelLoadError

_INSTALL_HINT = (
    "pip install 'minions-local[gguf]' with CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" set (a native build "
    "crashes on quantized models on AMX CPUs), or run scripts/build_llama_cpp_wheel.sh"
)
_GGML_LOG_ERROR = 4
_llama: Any = None
_log_callback: Any = None  # must outlive every llama.cpp call that may log
_log_sinks: list[tuple[int, list[str], list[str] | None]] = []
"""Each open `log_lines` block's thread, its lines, and the error lines it holds back from
stderr (None: it holds none)."""
_BUFFER_LINE = re.compile(r"\b(KV|output|compute) buffer size =\s*([0-9.]+) MiB")


@contextlib.contextmanager
def log_lines(*, hold_errors: bool = False) -> Iterator[list[str]]:
    """Every line llama.cpp logs inside the block on this thread (and the lines of threads
    in no block of their own: ggml's workers). `hold_errors`: its errors reach stderr
    only if the block ends without raising; a load that fails is then said by the error
    the caller raises (naming the file and what to do), not by llama.cpp's lines.
    Per thread, because a target's model loads on a thread of its own beside the cut's
    (llama_load._check_cut) or from before the imports (llama_early.py): each load's
    error is said with its own lines."""
    sink: tuple[int, list[str], list[str] | None] = (threading.get_ident(), [], [] if hold_errors else None)
    _log_sinks.append(sink)
    try:
        yield sink[1]
    except BaseException:
        if sink[2] is not None:
            sink[2].clear()
        raise
    finally:
        _log_sinks.remove(sink)
        if sink[2]:
            _write_errors(sink[2], sink[0])


@contextlib.contextmanager
def buffer_report() -> Iterator[dict[str, int]]:
    """Bytes of each buffer llama.cpp reports allocating inside the block ("KV",
    "output", "compute"; summed over devices). Its own report, because the compute
    buffer's size comes from planning a worst-case graph that no formula here mirrors."""
    sizes: dict[str, int] = {}
    with log_lines() as lines:
        try:
            yield sizes
        finally:
            for match in _BUFFER_LINE.finditer("".join(lines)):
                sizes[match[1]] = sizes.get(match[1], 0) + round(float(match[2]) * 2**20)


_switches = threading.Condition()
_switch_holders: list[dict[str, str]] = []
"""The settings of each load inside load_switches now (all equal)."""
_switches_before: dict[str, str | None] = {}
"""The environment's values of those settings before the first of them."""


class SwitchHold:
    """A load's hold on the switches (load_switches): `release()` lets loads asking other
    switches go on once llama.cpp has read these (load_model_file: at its buffers' log line)."""

    def __init__(self, settings: dict[str, str]) -> None:
        self.settings = settings
        self.held = False

    def take(self) -> None:
        with _switches:
            _switches.wait_for(lambda: not _switch_holders or _switch_holders[0] == self.settings)
            if not _switch_holders:
                _switches_before.clear()
                _switches_before.update({name: os.environ.get(name) for name in self.settings})
                os.environ.update(self.settings)
            _switch_holders.append(self.settings)
            self.held = True

    def release(self) -> None:
        with _switches:
            if not self.held:
                return
            self.held = False
            _switch_holders.remove(self.settings)
            if not _switch_holders:
                for name, value in _switches_before.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
                _switches.notify_all()


@contextlib.contextmanager
def load_switches(*, repack: bool = False, prefetch: bool = True) -> Iterator[SwitchHold]:
    """Inside the block (a model's load), our patched llama.cpp's load-time switches
    (scripts/llama_cpp_patches/), read from the environment as the file is mapped and each
    weight's buffer chosen; without the patches they change nothing.
      - repack: ggml repacks no weights but its Q4_K matrices, interleaved for the tiled
        kernel's 16-row form, whose outputs keep the file layout's bits
        (GGML_CPU_TILED_REPACK=1; on a CPU without AVX-512 VNNI nothing is repacked).
        Outside it (a minion's load) ggml keeps its own faster repacked layouts.
      - prefetch=False: the file is mapped without being read ahead (LLAMA_MMAP_PREFETCH=0),
        for a model whose layers stream (llama_stream.py), which reads what it keeps itself.
    Loads with the same switches hold them together (a model held in RAM loads beside its
    cut, both interleaved); one with others, none included (a minion's), waits until those
    loads are done or have released them (SwitchHold.release)."""
    hold = SwitchHold({**({"GGML_CPU_TILED_REPACK": "1"} if repack else {}),
                       **({} if prefetch else {"LLAMA_MMAP_PREFETCH": "0"})})
    hold.take()
    try:
        yield hold
    finally:
        hold.release()


def load_model_file(lib: Any, path: str | os.PathLike, params: Any, *, interleave: bool,
                    prefetch: bool = True) -> Any:
    """llama.cpp's load of the model file at `path` with `params`, inside the switches it
    asks (`interleave`: the interleaved Q4_K copy of a target held in RAM; else ggml's own
    layouts, a minion's); a target's load, its early load (llama_early.py) and a GGUF
    minion's make this call. NULL where llama.cpp refuses the file.

    The switches are let go once llama.cpp logs its weights' buffers ("model buffer size"):
    by then it has mapped the file and chosen and made every weight's buffer (what reads
    the switches), and what is left is reading and copying the weights, seconds of an 8B
    held in RAM, during which a minion's load (other switches) goes on instead of waiting.
    A log line, not llama.cpp's progress callback: that one is called for every tensor,
    each call waiting for the GIL while the imports hold it (the 8B's load beside a busy
    interpreter took 8.6-13.3 s against 6.2-9.5 without)."""
    with load_switches(repack=interleave, prefetch=prefetch) as hold:
        thread = threading.get_ident()
        _line_watchers[thread] = lambda line: hold.release() if _BUFFERS_MADE in line else None
        try:
            return lib.llama_model_load_from_file(os.fsencode(path), params)
        finally:
            _line_watchers.pop(thread, None)


_BUFFERS_MADE = "model buffer size"
_line_watchers: dict[int, Any] = {}
"""A function per thread given each line llama.cpp logs on that thread (load_model_file)."""


def drop_held_errors() -> None:
    """Forget the errors this thread's innermost holding block holds so far: an attempt
    that failed and whose fallback says what is wrong in its own words."""
    held = _innermost_held([s for s in _log_sinks if s[0] == threading.get_ident()])
    if held is not None:
        held.clear()


def _innermost_held(sinks: list[tuple[int, list[str], list[str] | None]]) -> list[str] | None:
    return next((held for _, _, held in reversed(sinks) if held is not None), None)


def _write_errors(errors: list[str], ending: int | None = None) -> None:
    """Errors to the innermost block holding them, else to stderr: for a line just logged,
    its thread's block (or any, from a thread in none); for the errors of a block `ending`
    on that thread, an enclosing block of the same thread only (another thread's load
    must not take them, nor drop them if it fails)."""
    sinks = [s for s in _log_sinks if s[0] == ending] if ending is not None else _sinks_of(threading.get_ident())
    holding = _innermost_held(sinks)
    if holding is not None:
        holding.extend(errors)
    else:
        sys.stderr.write("".join(errors))


def _sinks_of(thread: int) -> list[tuple[int, list[str], list[str] | None]]:
    """The log_lines blocks a line logged on `thread` goes to: its own, or every block where
    it has none (a ggml worker's line)."""
    sinks = list(_log_sinks)
    return [s for s in sinks if s[0] == thread] or sinks


def llama_cpp_refusal(path: str | os.PathLike) -> str | None:
    """What llama.cpp says when it cannot load the model at `path`; '' when it can; None
    where it cannot be asked (no usable llama-cpp-python) or gave no reason.

    llama.cpp keeps its architectures to itself (no list in its API), so it is asked: a
    vocabulary-only load (the header and the vocabulary: 0.1 s for an 8B file), in this
    process, its lines this thread's own (log_lines). It was a child interpreter before
    the log was per thread: 0.3-0.4 s of a first chat's load, on its critical path."""
    try:
        lib = import_llama_cpp()
    except (ModelLoadError, ImportError, OSError):
        return None
    params = lib.llama_model_default_params()
    params.vocab_only = True
    with log_lines(hold_errors=True) as lines:
        model = lib.llama_model_load_from_file(os.fsencode(path), params)
        drop_held_errors()  # the caller says it in its own words
    if model:
        lib.llama_model_free(model)
        return ""
    return load_error_reason("".join(lines))


def load_error_reason(said: str) -> str | None:
    """llama.cpp's last reason for refusing a model in its log text `said`, if it gave one."""
    reasons = re.findall(r"error loading model: (.*)", said)
    return reasons[-1].strip() if reasons else None


_switches_late = False


def switches_may_be_late() -> bool:
    """Whether llama_cpp was imported before import_llama_cpp set ggml's kernel switches
    (and the environment did not have them): a matmul run before then fixed ggml's kernel
    choice, and rows may round apart. Seen when a test loaded a model with llama_cpp.Llama
    first: every later target then failed its exactness check."""
    return _switches_late


def import_llama_cpp() -> Any:
    """llama_cpp, initialised once with its chatty logging reduced to errors (once, also
    when an early model load's thread and the engine's ask at the same time)."""
    with _import_lock:
        return _import_llama_cpp()


_import_lock = threading.Lock()


def _import_llama_cpp() -> Any:
    global _llama, _log_callback, _switches_late
    if _llama is None:
        problem = build_problem()
        if problem:
            raise ModelLoadError(problem + ".")
        _switches_late = "llama_cpp" in sys.modules and "GGML_CPU_TILED_MM_FORCE" not in os.environ
        # A llama.cpp target must give a row the same bits in a pass of any size
        # (llama_target.py). ggml multiplies K-quant and I-quant weights with its tiled kernel
        # from 8 rows and with `vec_dot` below: each is row-invariant, but they round apart,
        # so the tiled kernel is taken at every row count. It is also the faster of the two
        # for the trees a target runs (an 8B-shaped Q4_K_M on 2 AVX-512 cores: 16 rows 1.0 s
        # against 1.7-2.4, 63 rows 2.3-2.6 s against 7-8). The wheel our build script makes
        # patches it for few rows (scripts/llama_cpp_patches/): on VNNI CPUs a lone row then
        # takes 0.19-0.25 s (unpatched 0.9, `vec_dot` 0.2) and 4 rows 0.32; on 2 AVX2-only
        # cores 0.26-0.29 s (unpatched 1.9, llama.cpp's own 0.2) and 8 rows 0.6-0.8 (unpatched
        # 1.8); the same bits.
        # ggml reads the switches once, at the process's first matmul, so they are set before
        # anything runs, for the minions too (weights a minion repacks are not affected).
        os.environ.setdefault("GGML_CPU_TILED_MM", "1")
        os.environ.setdefault("GGML_CPU_TILED_MM_FORCE", "1")
        try:
            import llama_cpp
        except ImportError as err:
            raise ModelLoadError(f"GGUF minions need llama-cpp-python ({err}): {_INSTALL_HINT}.") from None

        def log(level: int, text: bytes, _user: Any) -> None:
            line = text.decode("utf-8", "replace")
            thread = threading.get_ident()
            for _, lines, _ in _sinks_of(thread):
                lines.append(line)
            watcher = _line_watchers.get(thread)
            if watcher is not None:
                try:
                    watcher(line)
                except Exception:  # noqa: BLE001 - a callback that raises loses the line's caller
                    pass
            if level == _GGML_LOG_ERROR:
                _write_errors([line])

        _log_callback = llama_cpp.llama_log_callback(log)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _llama = llama_cpp
    return _llama


def ggml_function(name: str, restype: Any, argtypes: list[Any]) -> Any:
    """A function of the ggml library that llama-cpp-python loads but does not bind."""
    lib = import_llama_cpp()
    ggml = ctypes.CDLL(str(Path(lib.__file__).parent / "lib" / "libggml-base.so"))
    fn = getattr(ggml, name)
    fn.restype, fn.argtypes = restype, argtypes
    return fn


@dataclass(frozen=True, slots=True)
class SeqBlock:
    """The sequence ids one request owns in a shared context: `first` holds its
    committed tokens, the rest one tree node each."""

    context: LlamaContext
    index: int
    first: int
    size: int

    @property
    def tree_seqs(self) -> range:
        return range(self.first + 1, self.first + self.size)


KV_TYPES = {"f32": 0, "f16": 1}  # GGML_TYPE_F32, GGML_TYPE_F16
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ


def runs_per_block(runs: int, blocks: int) -> int:
    """Tree nodes one request runs per grow in a context of `blocks` requests (at most
    `runs`): the 256 sequence ids split between them, one of each block holding the
    request's prefix."""
    return max(1, min(runs, MAX_SEQUENCES // blocks - 1))


def context_params(lib: Any, *, n_ctx: int, blocks: int, runs: int, n_batch: int, threads: int,
                   kv_type: str) -> Any:
    """A context for `blocks` requests of n_ctx tokens each, in one unified KV cache."""
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = n_ctx * blocks
    cparams.n_batch = cparams.n_ubatch = n_batch
    # llama.cpp reserves at least one output row per sequence and aborts the process
    # (GGML_ASSERT) if that exceeds n_outputs_max, which defaults to n_batch.
    cparams.n_seq_max = (runs_per_block(runs, blocks) + 1) * blocks  # + each request's prefix sequence
    cparams.n_outputs_max = max(n_batch, cparams.n_seq_max)
    cparams.kv_unified = True
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.type_k = cparams.type_v = KV_TYPES[kv_type]
    cparams.no_perf = True
    if kv_type == "f32":  # CPU flash attention is ~3e-4 off HF (measured); plain attention ~4e-7
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
    return cparams


class LlamaContext:
    """One llama.cpp context (KV cache, batch, logits) split into `blocks` blocks of
    sequence ids, one per request. `ctx` is a context made with n_seq_max a multiple
    of `blocks`; this object owns it from now on."""

    def __init__(self, lib: Any, ctx: Any, *, blocks: int, n_batch: int, vocab_size: int, threads: int) -> None:
        self.lib, self.ctx = lib, ctx
        self.mem = lib.llama_get_memory(ctx)
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.n_batch, self.vocab_size = n_batch, vocab_size
        self.block_size = int(lib.llama_n_seq_max(ctx)) // blocks
        self.blocks = blocks
        self._free = list(range(blocks - 1, -1, -1))  # pop() takes the lowest
        self._threads = threads

    @property
    def idle(self) -> bool:
        """No request holds a block of it."""
        return len(self._free) == self.blocks

    def take(self) -> SeqBlock | None:
        """A free block of sequence ids, or None when every block is held."""
        if not self._free:
            return None
        index = self._free.pop()
        return SeqBlock(self, index, index * self.block_size, self.block_size)

    def give_back(self, block: SeqBlock) -> None:
        """Free a block and every cell its sequences hold."""
        for seq in range(block.first, block.first + block.size):
            self.lib.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self._free.append(block.index)
        self._free.sort(reverse=True)

    def use_threads(self, threads: int) -> None:
        """llama.cpp's thread count for the passes that follow (grow or background)."""
        if threads != self._threads:
            self.lib.llama_set_n_threads(self.ctx, threads, threads)
            self._threads = threads

    @contextlib.contextmanager
    def running_on(self, threads: int) -> Iterator[None]:
        """The passes inside on `threads` threads (a grow or a batch's prompt reads,
        while the target waits), then back to the count before."""
        before = self._threads
        self.use_threads(threads)
        try:
            yield
        finally:
            self.use_threads(before)

    def decode(self, tokens: list[int], positions: list[int], seqs: list[int], outputs: list[bool]) -> np.ndarray:
        """Run tokens (each at its position, in its sequence), n_batch per llama_decode,
        and return the logits of those marked in `outputs`, in order ([rows, vocab]).
        Raises RuntimeError on a failed pass: the cells it wrote may be half-written."""
        lib, batch = self.lib, self.batch
        out = np.empty((sum(outputs), self.vocab_size), dtype=np.float32)
        row = 0
        for start in range(0, len(tokens), self.n_batch):
            end = min(start + self.n_batch, len(tokens))
            batch.n_tokens = end - start
            for i in range(start, end):
                j = i - start
                batch.token[j] = tokens[i]
                batch.pos[j] = positions[i]
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = seqs[i]
                batch.logits[j] = outputs[i]
            status = lib.llama_decode(self.ctx, batch)
            if status != 0:  # 1 = no KV slot; anything else is an internal error
                raise RuntimeError(f"llama_decode failed with status {status} ({end - start} tokens)")
            for i in range(start, end):
                if outputs[i]:
                    ptr = lib.llama_get_logits_ith(self.ctx, i - start)
                    out[row] = np.ctypeslib.as_array(ptr, shape=(self.vocab_size,))
                    row += 1
        return out

    def close(self) -> None:
        if self.batch is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            self.lib.llama_free(self.ctx)
            self.ctx = None
