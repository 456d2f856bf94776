"""How much memory this machine can give a model now: the budget of a target named on the
command line, which the profile's own budgets (written for its own model) do not describe.

Linux says it in two places, and the smaller one binds:
  - /proc/meminfo's MemAvailable: what the kernel can hand out without swapping (free
    memory plus the page cache and caches it can reclaim);
  - the memory cgroup the process lives in (a container's limit, a systemd slice, one
    made by hand), at every level from its own up to the root: the limit less what is
    charged to it, v1 (`memory.limit_in_bytes`, `memory.usage_in_bytes`) or v2
    (`memory.max`, `memory.current`). The page cache charged to it counts as free, as
    MemAvailable counts it: after one run has read a model file, the cgroup is full of
    that file's pages, which the next run's own reads simply replace.
Less a reserve for the process itself (the interpreter, torch and llama.cpp's code).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GB = 1e9
RESERVE = 500_000_000
"""What the process holds before any model: 0.26 GB once torch, transformers and llama.cpp
are imported, 0.5-0.8 GB with SmolLM2's target and minion loaded (which the plan counts)."""
_UNLIMITED = 1 << 60
"""Above this a v1 limit means none (the kernel writes 2^63 rounded down to a page)."""


@dataclass(frozen=True)
class MachineMemory:
    """Bytes a model may take now, and where the number came from."""

    usable: int
    source: str
    """'MemAvailable 22.8 GB' or 'cgroup limit 3.5 GB, 3.4 GB of it free'."""
    reserve: int

    def describe(self) -> str:
        return f"{_gb(self.usable)} usable ({self.source}, less {_gb(self.reserve)} for this process)"


def usable_memory(*, proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup"),
                  reserve: int = RESERVE) -> MachineMemory | None:
    """The memory usable now (see the module); None where this is no Linux that says."""
    available = mem_available(proc)
    limit = cgroup_room(proc, cgroups)
    if available is None and limit is None:
        return None
    if limit is not None and (available is None or limit[1] < available):
        room, source = limit[1], f"cgroup limit {_gb(limit[0])}, {_gb(limit[1])} of it free"
    else:
        room, source = available, f"MemAvailable {_gb(available)}"
    return MachineMemory(max(0, room - reserve), source, reserve)


def mem_available(proc: Path) -> int | None:
    for line in _read(proc / "meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def cgroup_room(proc: Path, cgroups: Path) -> tuple[int, int] | None:
    """(limit, free) of the tightest memory cgroup above this process, or None if none is limited."""
    tightest = None
    for folder in _cgroup_folders(proc, cgroups):
        level = _v1_room(folder) if (folder / "memory.limit_in_bytes").is_file() else _v2_room(folder)
        if level is not None and (tightest is None or level[1] < tightest[1]):
            tightest = level
    return tightest


def _cgroup_folders(proc: Path, cgroups: Path) -> list[Path]:
    """The process's memory cgroup folders (/proc/self/cgroup: 'id:controllers:path'), its
    own and each one above it. In a container the mount may show only its own cgroup at
    the mount's root, where the path named does not exist."""
    found: list[Path] = []
    for line in _read(proc / "self" / "cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "memory" in controllers.split(","):
            roots = [cgroups / "memory"]
        elif controllers == "":
            roots = [cgroups, cgroups / "unified"]
        else:
            continue
        for root in roots:
            folder = root / path.strip("/")
            while folder != root and not folder.is_dir():
                folder = folder.parent
            while True:
                found.append(folder)
                if folder == root:
                    break
                folder = folder.parent
    return found


def _v1_room(folder: Path) -> tuple[int, int] | None:
    limit, usage = _number(folder / "memory.limit_in_bytes"), _number(folder / "memory.usage_in_bytes")
    if limit is None or usage is None or limit >= _UNLIMITED:
        return None
    stat = _stat(folder / "memory.stat")
    cache = stat.get("total_inactive_file", 0) + stat.get("total_active_file", 0)
    return limit, max(0, limit - usage + min(cache, usage))


def _v2_room(folder: Path) -> tuple[int, int] | None:
    limit, usage = _number(folder / "memory.max"), _number(folder / "memory.current")
    if limit is None or usage is None:
        return None
    stat = _stat(folder / "memory.stat")
    cache = stat.get("inactive_file", 0) + stat.get("active_file", 0)
    return limit, max(0, limit - usage + min(cache, usage))


def _number(path: Path) -> int | None:
    text = _read(path).strip()
    return int(text) if text.isdigit() else None  # v2 writes 'max' for no limit


def _stat(path: Path) -> dict[str, int]:
    out = {}
    for line in _read(path).splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _gb(n: int) -> str:
    return f"{n / GB:.1f} GB"
