"""Loading a GGUF target onto llama.cpp: the file checked first, the exactness of its
rows checked once per file and build, and its tokenizer.

The check (`rows_differ`) is the promise llama_target.py makes, tried on the loaded
file with this build of llama.cpp on this CPU: a prompt read in one chunk and a tree
below it, against the same prompt read as 1 token + the rest and the tree's deepest
path as 1-token passes, compared bit for bit (logits and cache entries). A kernel this
build picks by batch shape for some quant type would fail it; the target then refuses
to load rather than reply differently from itself. A new file is checked on a cut of
it (llama_check_model.py: the fewest layers that hold all its tensor kinds, in memory;
1.1 s where the whole 8B took 10 of a first chat's 20 s), the whole model only where
llama.cpp will not load the cut, and through the split when layers live on RPC servers.
The verdict is kept in the user cache by file (size, mtime), llama.cpp build and CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from minions_local.backends.llama_context import drop_held_errors, load_error_reason, log_lines, switches_may_be_late
from minions_local.backends.llama_early import drop_early_models
from minions_local.backends.llama_rpc import DEFAULT_TIMEOUT
from minions_local.backends.llama_stream import (FileReadAhead, PageCacheStreamer, Span, claim_read_ahead, layer_spans,
                                                  resident_spans)
from minions_local.backends.llama_target import LlamaTarget
from minions_local.backends.llama_vocab import LlamaVocab
from minions_local.core.errors import ModelLoadError
from minions_local.core.events import LoadProgress
from minions_local.core.tree import TokenTree
from minions_local.models.llama_probe import unknown_architecture, unknown_architecture_message
from minions_local.profile.gguf_sizes import llama_cache_cells

Progress = Callable[[LoadProgress], None]
CHECK_VERSION = 4  # 4: a model held in RAM checked (and timed) over the interleaved Q4_K copy
INTERLEAVED = "q4_K interleaved"


def load_llama_target(path: Path, *, context_tokens: int = 4096, threads: int | None = None,
                      layer_tiers: list[str] | None = None, window: int = 2,
                      progress: Progress | None = None, rpc: dict[str, Any] | None = None,
                      time_shape: Callable[[LlamaTarget], list[tuple[int, float]]] | None = None,
                      time_lone: Callable[[LlamaTarget], float] | None = None
                      ) -> tuple[LlamaTarget, LlamaVocab]:
    """A GGUF target on llama.cpp and its tokenizer; ModelLoadError names the file and what
    to do when the file is not a usable model or its rows would not be exact here.

    path: the model's file, or any shard of a split one (llama.cpp is given the first and
    maps every shard; the streamer steers all of them).
    layer_tiers: the memory plan's tier per decoder layer; layers not on 'device' stream
    through the page cache, `window` layers ahead of the pass (llama_stream.py).
    rpc: the layers split over RPC servers (llama_remote.py): {"servers": ["host:port", ...],
    "shares": [this machine, server, ...] or None, "timeout": seconds}; nothing streams.
    time_shape: times a cut's passes of the cost model's sizes (calibration.time_pass_shape),
    which become the model's pass_shape; time_lone: times one 1-token pass of the model
    (calibration.time_lone_pass), what a streamed model's reads add to that shape."""
    from minions_local.models.gguf_file import read_model

    model = read_model(path)  # a truncated, corrupt or incomplete model is named here, before llama.cpp reads it
    path, total = model.path, model.size
    if progress:
        progress(LoadProgress("target", "ram", 0, total, "loading with llama.cpp"))
    train = _metadata_int(model.metadata, f"{model.architecture}.context_length")
    n_ctx = min(context_tokens, train) if train else context_tokens
    early = claim_read_ahead(model.paths)  # read since the path was known (planning/target_read_ahead.py)
    if rpc and rpc.get("servers"):
        _give_up_early(early, model.path)
        return _load_split(model, n_ctx, threads, progress, rpc)
    streamer = None
    if layer_tiers and any(t != "device" for t in layer_tiers):
        _give_up_early(early, model.path)  # the plan streams it after all: only the resident layers are read
        layers = len(layer_tiers)
        spans = layer_spans(model.files, layers)
        resident = spread_resident(layers, layer_tiers.count("device"))
        streamer = PageCacheStreamer(model.paths, spans, resident=resident, window=window)
        # llama.cpp maps a streamed file without reading it (load_switches): what stays is read here.
        ahead = FileReadAhead(model.paths, resident_spans(model.files, spans, resident))
    else:
        ahead = early or FileReadAhead(model.paths, [Span(i, 0, f.size) for i, f in enumerate(model.files)])
    try:
        return _load_local(model, n_ctx, threads, progress, streamer, time_shape, time_lone)
    finally:
        ahead.stop()


def _give_up_early(reader: FileReadAhead | None, path: Path) -> None:
    """What was started for a target held in RAM, where it will not be: the whole file's
    reader stops, and the model loaded early is freed before the file is mapped again."""
    if reader is not None:
        reader.stop()
    drop_early_models(path)


def _load_local(model: Any, n_ctx: int, threads: int | None, progress: Progress | None,
                streamer: PageCacheStreamer | None,
                time_shape: Callable[[LlamaTarget], list[tuple[int, float]]] | None,
                time_lone: Callable[[LlamaTarget], float] | None) -> tuple[LlamaTarget, LlamaVocab]:
    """load_llama_target on this machine, its file being read meanwhile (FileReadAhead)."""
    path, total = model.path, model.size
    cells = llama_cache_cells(n_ctx)
    # Held in RAM, its Q4_K matrices are interleaved at load (llama_target.py): the check
    # runs that layout's kernel, and its verdict is kept apart from the streamed layout's.
    interleave = streamer is None
    variant = INTERLEAVED if interleave else ""

    def open_target() -> LlamaTarget:
        return _open(model, n_ctx=cells, threads=threads, streamer=streamer, interleave=interleave)

    entry, target = _cached_entry(model.paths, variant), None
    if entry is None:
        # All of it in memory: llama.cpp reads the file while the CPU checks the cut. (A
        # streamed target loads after: the cut's memory must be gone before it maps.)
        entry, target = _check_cut(model, cells, threads, progress, time_shape, interleave=interleave,
                                   meanwhile=open_target if streamer is None else None)
        if entry is not None:
            _store_entry(model.paths, entry, variant)
    if target is None:
        target = open_target()
    try:  # the verdict found above (cached, or the cut's), else the whole model's
        verdict = entry["verdict"] if entry is not None else _checked(target, model.paths, progress, variant)
        if verdict and switches_may_be_late():
            raise ModelLoadError(
                f"llama.cpp gave {path.name}'s tree rows other bits than 1-token passes ({verdict}), and this "
                f"process imported llama_cpp before minions-local set ggml's kernel switches, so that may be why. "
                f"Import minions_local (or load this target) before using llama_cpp yourself, or set "
                f"GGML_CPU_TILED_MM=1 and GGML_CPU_TILED_MM_FORCE=1 in the environment.")
        if verdict:
            raise ModelLoadError(
                f"llama.cpp does not give {path.name}'s tree rows the bits of 1-token passes on this machine "
                f"({verdict}), so trees would change its replies. Re-quantize it to a K-quant (e.g. Q4_K_M) or "
                f"report the file's types; its tensor types: {_type_counts(model)}.")
        if entry and entry.get("shape") and (streamer is None or time_lone is not None):
            from minions_local.backends.llama_check_model import covering_layers, pass_bytes_ratio

            scale = pass_bytes_ratio(model, covering_layers(model))  # the cut's times, at the model's size
            target.pass_shape = [(int(n), float(t) * scale) for n, t in entry["shape"]]
            if streamer is not None:
                target.pass_shape = _with_reads(target, target.pass_shape, time_lone)
    except BaseException:
        target.close()
        raise
    if progress:
        progress(LoadProgress("target", "ram", total, total, "ready"))
    return target, LlamaVocab(target.lib, target.model)


def _checked(target: LlamaTarget, paths: list[Path], progress: Progress | None, variant: str = "") -> str:
    """rows_differ's verdict on the target, from the cache when this file, build, CPU (and
    variant: _verdict_key) were checked before."""
    verdict = _cached_verdict(paths, variant)
    if verdict is None:
        if progress:
            total = sum(p.stat().st_size for p in paths)
            progress(LoadProgress("target", "ram", total, total, "checking that its rows are exact"))
        verdict = rows_differ(target)
        _store_verdict(paths, verdict, variant)
    return verdict


def _with_reads(target: LlamaTarget, shape: list[tuple[int, float]],
                time_lone: Callable[[LlamaTarget], float]) -> list[tuple[int, float]]:
    """A streamed model's pass shape: one 1-token pass of the model itself, timed (its
    streamed layers' reads, which no cut in memory can say), plus what each size's rows
    add in the cut's shape (their compute). It stands for the three passes of the model
    the cost model would time otherwise: 7.0 of a 20.3 s first load for the 8B-shaped
    Q4_K_M under 3.5 GB (2-core AVX2 EPYC), each pass reading its 2.6 GB of streamed
    layers. A 40-node pass there took 5.35 s where this sum says 4.6 (the reads hide part
    of the compute, and the read-ahead thread takes CPU from it): the steps' own samples
    refit the rest (cost_policy)."""
    lone = time_lone(target)
    return [(n, lone + t - shape[0][1]) for n, t in shape]


def spread_resident(layers: int, resident: int) -> set[int]:
    """Which `resident` of `layers` layers stay in memory: the plan counts them, the loader
    places them, with the streamed ones spread evenly between. Streamed last, as the plan
    lists them, a tree pass computed the resident layers with nothing to read, then
    waited on the disk layer after layer (the reads run at most `window` layers ahead);
    spread, each streamed layer's read overlaps the resident layers computed before it:
    at 3.5 GB for the 8B-shaped Q4_K_M (2-core EPYC, 1.1 GB/s reads, 6.0 tokens a pass
    both ways), 4.02 tok/s against 3.28 streamed last."""
    streamed = layers - resident
    return set(range(layers)) - {int((k + 0.5) * layers / streamed) for k in range(streamed)} if streamed else \
        set(range(layers))


def _check_cut(model: Any, n_ctx: int, threads: int | None, progress: Progress | None,
               time_shape: Callable[[LlamaTarget], list[tuple[int, float]]] | None = None,
               interleave: bool = False,
               meanwhile: Callable[[], LlamaTarget] | None = None) -> tuple[dict[str, Any] | None, Any]:
    """rows_differ on a cut of the model (llama_check_model.py), and the cut's passes timed
    at the cost model's sizes: ({"verdict": ..., "shape": [(draft nodes, seconds), ...]},
    what `meanwhile` returned). `meanwhile` (the model's own load, mostly reading its file)
    runs in a thread while the cut's rows are checked, once the cut is loaded (llama.cpp's load logs
    what the plan reads: the two loads' lines must not mix). (None, None) where no cut is
    smaller than the model or llama.cpp cannot load it: the whole model is then checked,
    and `meanwhile` has not run. `interleave`: the cut loaded as a model held in RAM is."""
    from concurrent.futures import ThreadPoolExecutor

    from minions_local.backends.llama_check_model import covering_layers, cut_model_path
    from minions_local.backends.llama_rows import has_lone_row_types

    layers = covering_layers(model)
    if not layers or len(layers) >= (_metadata_int(model.metadata, f"{model.architecture}.block_count") or 0):
        return None, None
    if progress:
        progress(LoadProgress("target", "ram", 0, model.size,
                              f"checking that its rows are exact (on {len(layers)} of its layers)"))
    with contextlib.ExitStack() as stack:
        try:
            path = stack.enter_context(cut_model_path(model, layers))
            stack.enter_context(log_lines(hold_errors=True))
            cut = LlamaTarget(path, n_ctx=n_ctx, threads=threads, lone_rows=not has_lone_row_types(model.path),
                              interleave=interleave)
        except (ModelLoadError, OSError, ValueError):
            drop_held_errors()  # the whole model's load is tried next, and names what is wrong
            return None, None
        stack.callback(cut.close)
        with ThreadPoolExecutor(1, thread_name_prefix="minions-load") as pool:
            loading = pool.submit(meanwhile) if meanwhile is not None else None
            try:
                verdict = rows_differ(cut)
                if loading is not None:
                    cut.special_ids()  # its vocabulary is the file's: asked while the model loads
                target = loading.result() if loading is not None else None
                if target is not None:
                    target.same_vocabulary_as(cut)
            except BaseException:
                if loading is not None and loading.exception() is None:
                    loading.result().close()
                raise
        try:  # timed alone: beside the load's reads a 5-row pass took 3.0 1-row passes, not 2.6
            return {"verdict": verdict, "shape": time_shape(cut) if time_shape and not verdict else []}, target
        except BaseException:
            if target is not None:
                target.close()
            raise


def _load_split(model: Any, n_ctx: int, threads: int | None, progress: Progress | None,
                rpc: dict[str, Any]) -> tuple[LlamaTarget, LlamaVocab]:
    """The target split over this machine and RPC servers, its rows checked through the split."""
    from minions_local.backends.llama_remote import RemoteLlamaTarget

    def check(target: Any) -> str:
        return _checked(target, model.paths, progress, f"{target.servers}|{target.placement.layers}")

    if progress:
        progress(LoadProgress("target", "ram", 0, model.size, f"loading over {', '.join(rpc['servers'])}"))
    with log_lines(hold_errors=True) as lines:
        try:
            target = RemoteLlamaTarget(model.path, servers=rpc["servers"], shares=rpc.get("shares"),
                                       timeout=rpc.get("timeout") or DEFAULT_TIMEOUT, check_rows=check,
                                       n_ctx=llama_cache_cells(n_ctx), threads=threads)
        except ModelLoadError as err:
            reason = load_error_reason("".join(lines))
            raise ModelLoadError(f"{err}{f' llama.cpp said: {reason}.' if reason else ''}") from None
    if progress:
        progress(LoadProgress("target", "ram", model.size, model.size, f"ready: {target.describe_split()}"))
    return target, LlamaVocab(target.lib, target.vocabulary_model())


def _open(model: Any, **options: Any) -> LlamaTarget:
    """LlamaTarget on the model's first file; what llama.cpp said is in the error when it
    cannot load it (an architecture it does not know, above all)."""
    with log_lines(hold_errors=True) as lines:
        try:
            return LlamaTarget(model.path, **options)
        except ModelLoadError as err:
            said = "".join(lines)
            unknown = unknown_architecture(said)
            if unknown:
                raise ModelLoadError(unknown_architecture_message(model.path, unknown)) from None
            reason = load_error_reason(said)
            raise ModelLoadError(f"{err}{f' llama.cpp said: {reason}.' if reason else ''}") from None


def rows_differ(target: LlamaTarget) -> str:
    """'' when the target's rows are exact on this machine, else what differed. Leaves the
    target reset. Six passes (each one is seconds at 8B under a memory limit, and they are
    the cost model's timing too: LlamaTarget.first_passes): the prompt and a tree below it
    in one; then the prompt again as 1 row and the rest with the tree's root, and the
    tree's path to a node 3 deep as 1-token passes."""
    vocab = target.vocab_size
    g = np.random.default_rng(0)
    prompt = [int(t) for t in g.integers(0, vocab, 80)]  # with the tree: one call of 64+ rows
    tree = TokenTree.from_root(prompt[-1])
    for _ in range(20):
        tree.add(int(g.integers(0, len(tree))), int(g.integers(0, vocab)), score=float(g.random()))
    target.use_slot(0)
    target.reset()
    whole = target.verify(prompt, tree).numpy().copy()  # the prompt rides the tree's pass
    # A path 3 deep checks the tree's mask with ancestors as well as a deeper one does.
    deepest = max(range(len(tree)), key=lambda n: min(tree.depths[n], 3))
    path = [deepest]
    while path[-1]:
        path.append(tree.parents[path[-1]])
    path.reverse()
    target.reset()
    target.prefill(prompt[:2])  # a lone row; the rest of the prompt rides the root's pass
    context = list(prompt)
    problem = ""
    for node in path:
        step = TokenTree.from_root(context[-1])
        logits = target.verify(context, step)[0].numpy()
        if not np.array_equal(logits, whole[node]):
            problem = f"tree node {node} at depth {tree.depths[node]}: up to {np.abs(logits - whole[node]).max():.3g}"
            break
        target.commit(step, [0])
        if node != path[-1]:
            context.append(tree.tokens[path[path.index(node) + 1]])
    target.reset()
    return problem


def _metadata_int(metadata: dict[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    return int(value) if isinstance(value, (int, np.integer)) else None


def _type_counts(file) -> str:
    counts: dict[str, int] = {}
    for t in file.tensors.values():
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _verdict_key(paths: list[Path], variant: str = "") -> str:
    """The cache's key for a verdict: the files, the llama.cpp build, the CPU, and `variant`,
    what else the kernels depend on: the split over RPC servers (their kernels are checked
    too), or INTERLEAVED (a model held in RAM runs the interleaved copy's kernel)."""
    import platform

    import llama_cpp

    files = "|".join(f"{p.resolve()}|{p.stat().st_size}|{p.stat().st_mtime_ns}" for p in paths)
    stamp = Path(llama_cpp.__file__).parent / ".minions-build"
    build = stamp.read_text().strip() if stamp.is_file() else ""
    cpu = ""
    try:
        cpu = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    raw = f"{CHECK_VERSION}|{files}|{llama_cpp.__version__}|{build}|{platform.machine()}|{cpu}"
    if variant:
        raw += f"|{variant}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _verdicts_file() -> Path:
    from minions_local.models.builtin import cache_root

    return cache_root() / "llama-row-checks.json"


def _cached_verdict(paths: list[Path], variant: str = "") -> str | None:
    entry = _cached_entry(paths, variant)
    return None if entry is None else entry["verdict"]


def _cached_entry(paths: list[Path], variant: str = "") -> dict[str, Any] | None:
    """What the check found for these files here: {"verdict": '' or what differed,
    "shape": the cut's timed passes, when a cut was checked}."""
    try:
        entry = json.loads(_verdicts_file().read_text()).get(_verdict_key(paths, variant))
    except (OSError, ValueError):
        return None
    return {"verdict": entry} if isinstance(entry, str) else entry if isinstance(entry, dict) else None


def _store_verdict(paths: list[Path], verdict: str, variant: str = "") -> None:
    _store_entry(paths, {"verdict": verdict}, variant)


def _store_entry(paths: list[Path], entry: dict[str, Any], variant: str = "") -> None:
    if entry["verdict"] and switches_may_be_late():
        return  # a failure of ggml's kernel choice in this process, not of the file: no later process may trust it
    file = _verdicts_file()
    try:
        known = json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, ValueError):
        known = {}
    known[_verdict_key(paths, variant)] = entry
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(file)
    except OSError:
        pass  # a read-only cache: the check runs again next time
