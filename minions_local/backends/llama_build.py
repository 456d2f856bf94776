"""Whether the installed llama-cpp-python was built for this CPU.

scripts/build_llama_cpp_wheel.sh builds it with the x86 extensions the building CPU has
(AVX-512, VNNI, ...) and leaves a stamp naming them next to the package. A build moved
to a CPU without them dies of an illegal instruction at its first matmul, killing the
chat with no message; so before llama.cpp is loaded, the stamp is checked against
/proc/cpuinfo and a mismatch becomes a message that says how to rebuild.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

STAMP = ".minions-build"

_NEEDS = {
    "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"),
    "avx512vbmi": ("avx512vbmi",),
    "avx512_vnni": ("avx512_vnni",),
    "avx512_bf16": ("avx512_bf16",),
    "avx_vnni": ("avx_vnni",),
}
"""Each extension the build script may name in its stamp, and the /proc/cpuinfo flags it needs."""


def missing_extensions(stamp: str, cpu_flags: set[str]) -> list[str]:
    """The extensions a build's stamp (e.g. "x86-avx512-avx512_vnni-nocommon") names that
    a CPU with `cpu_flags` lacks."""
    named = [part for part in stamp.strip().split("-") if part in _NEEDS]
    return [ext for ext in named if not all(flag in cpu_flags for flag in _NEEDS[ext])]


def build_problem() -> str | None:
    """A message when the installed llama-cpp-python needs CPU extensions this CPU
    lacks; None when it fits, or when there is nothing to go by (no stamp, no cpuinfo)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        return None
    try:
        stamp = (Path(spec.origin).parent / STAMP).read_text()
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    if flags is None:
        return None
    missing = missing_extensions(stamp, set(flags))
    if not missing:
        return None
    return (f"The installed llama-cpp-python was built for a CPU with {', '.join(missing)}, which this CPU "
            f"lacks: it would crash at its first pass. Rebuild it for this machine: "
            f"bash scripts/build_llama_cpp_wheel.sh (MINIONS_LLAMA_CPU=portable for a build that runs anywhere)")
