"""A cgroup v1 memory group for one child process: how the benchmark runs llama.cpp
on a model that does not fit in memory.

llama.cpp has no layer streaming: it mmaps the GGUF and lets the kernel page it in.
Without a limit the whole model stays in the page cache after the first pass and
llama.cpp runs at RAM speed, which is not the disk tier. Inside a memory group whose
limit is smaller than the model, the kernel must evict mapped weight pages to fault
in the next ones, so each pass reads most of the model from disk again: the
"mmap under memory pressure" way a too-large model runs with llama.cpp.

The group is made for the benchmark's own child (named after the benchmark's pid),
and removed afterwards. Where it cannot be made (not root, no v1 memory controller,
read-only /sys), `MemoryGroup.create` raises `NoMemoryGroup` saying why, and the
benchmark says so in its output.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")


class NoMemoryGroup(RuntimeError):
    """Why no memory group could be made here."""


class MemoryGroup:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, name: str, root: Path = ROOT) -> "MemoryGroup":
        if not (root / "memory.limit_in_bytes").is_file():
            raise NoMemoryGroup(f"no cgroup v1 memory controller at {root}")
        path = root / name
        try:
            path.mkdir()
        except FileExistsError:
            pass  # left by an earlier run of this pid: reuse it
        except OSError as err:
            raise NoMemoryGroup(f"cannot make the memory group {path}: {err.strerror or err} "
                                f"(it needs root and a writable cgroup v1 memory controller)") from None
        group = cls(path)
        for name, value in (("memory.swappiness", "0"),  # no swap here anyway; never trade anon pages for cache
                            ("memory.move_charge_at_immigrate", "3")):  # what the child holds moves in with it
            try:
                group._write(name, value)
            except OSError:
                pass  # not every kernel lets a child group set these; the limit is what matters
        return group

    def _write(self, name: str, value: str) -> None:
        with open(self.path / name, "w") as f:
            f.write(value)

    def _read_int(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    def add(self, pid: int) -> None:
        """Move process `pid` into the group (its later page faults are charged here)."""
        self._write("cgroup.procs", str(pid))

    def set_limit(self, nbytes: int) -> None:
        """Lowering the limit below the usage makes the kernel reclaim page cache first."""
        self._write("memory.limit_in_bytes", str(int(nbytes)))

    @property
    def limit(self) -> int:
        return self._read_int("memory.limit_in_bytes")

    @property
    def usage(self) -> int:
        return self._read_int("memory.usage_in_bytes")

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer fired in this group (the limit was below what
        the process itself needs, not only below its page cache)."""
        try:
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
        except (OSError, ValueError):
            pass
        return False

    def remove(self, timeout: float = 30.0) -> None:
        """Remove the group once its processes have exited (their page cache charges move
        to the parent group). Raises OSError if it stays busy past `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as err:
                if err.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                try:
                    self._write("memory.force_empty", "0")
                except OSError:
                    pass
                time.sleep(0.1)


_groups = itertools.count(1)


def group_name(tag: str) -> str:
    """A name no other group of this process has: two children (a benchmark run inside
    a test whose fixture holds another) must never share a group, or removing one's
    waits on the other's process."""
    return f"minions-bench-{os.getpid()}-{tag}-{next(_groups)}"
