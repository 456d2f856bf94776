"""This machine's usable memory (planning/machine_memory.py), read from fake /proc and
/sys/fs/cgroup trees: MemAvailable, or a v1 / v2 memory cgroup's limit less its usage
(its page cache counted free), the tightest level binding, less the process's reserve."""

from __future__ import annotations

from pathlib import Path

from minions_local.planning.machine_memory import usable_memory

GiB = 1 << 30
RESERVE = 500_000_000


def machine(tmp_path: Path, *, available_kb: int | None = 20 * GiB // 1024, cgroup: str = "",
            groups: dict[str, dict[str, str]] | None = None) -> dict[str, Path]:
    proc, sys_cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    lines = ["MemTotal:       24684084 kB"] + ([f"MemAvailable:   {available_kb} kB"] if available_kb else [])
    (proc / "meminfo").write_text("\n".join(lines) + "\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    for folder, files in (groups or {}).items():
        (sys_cg / folder).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (sys_cg / folder / name).write_text(text)
    return {"proc": proc, "cgroups": sys_cg}


def v1(limit: int, usage: int, cache: int = 0) -> dict[str, str]:
    return {"memory.limit_in_bytes": f"{limit}\n", "memory.usage_in_bytes": f"{usage}\n",
            "memory.stat": f"cache {cache}\ntotal_inactive_file {cache // 2}\ntotal_active_file {cache - cache // 2}\n"}


UNLIMITED = v1(9223372036854771712, 6 * GiB)


def test_without_a_limit_it_is_mem_available_less_the_reserve(tmp_path):
    found = usable_memory(**machine(tmp_path, cgroup="4:memory:/\n0::/\n", groups={"memory": UNLIMITED}))
    assert found.usable == 20 * GiB - RESERVE
    assert found.describe() == "21.0 GB usable (MemAvailable 21.5 GB, less 0.5 GB for this process)"


def test_a_v1_limit_binds_with_its_page_cache_counted_free(tmp_path):
    """3.5 GB limit, 3.4 GB charged of which 3 GB is a model file's pages from an earlier run."""
    groups = {"memory": UNLIMITED, "memory/box": v1(3_500_000_000, 3_400_000_000, cache=3_000_000_000)}
    found = usable_memory(**machine(tmp_path, cgroup="9:cpu:/\n4:memory:/box\n", groups=groups))
    assert found.usable == 3_100_000_000 - RESERVE
    assert found.source == "cgroup limit 3.5 GB, 3.1 GB of it free"


def test_the_tightest_level_above_the_process_binds(tmp_path):
    groups = {"memory": UNLIMITED, "memory/slice": v1(2 * GiB, GiB), "memory/slice/job": v1(8 * GiB, GiB // 2)}
    found = usable_memory(**machine(tmp_path, cgroup="4:memory:/slice/job\n", groups=groups))
    assert found.usable == GiB - RESERVE and found.source.startswith("cgroup limit 2.1 GB")


def test_in_a_container_the_mount_root_is_its_own_cgroup(tmp_path):
    """/proc/self/cgroup names the host's path, which the container's mount does not show."""
    groups = {"memory": v1(3 * GiB, GiB)}
    found = usable_memory(**machine(tmp_path, cgroup="4:memory:/docker/abc123\n", groups=groups))
    assert found.usable == 2 * GiB - RESERVE


def test_cgroup_v2(tmp_path):
    groups = {"user.slice": {"memory.max": "max\n", "memory.current": "5\n"},
              "user.slice/app": {"memory.max": f"{4 * GiB}\n", "memory.current": f"{3 * GiB}\n",
                                 "memory.stat": f"anon {GiB}\nactive_file {GiB}\ninactive_file {GiB // 2}\n"}}
    found = usable_memory(**machine(tmp_path, cgroup="0::/user.slice/app\n", groups=groups))
    assert found.usable == GiB + GiB + GiB // 2 - RESERVE
    assert usable_memory(**machine(tmp_path / "b", cgroup="0::/user.slice\n", groups=groups)).source.startswith(
        "MemAvailable")  # 'max' is no limit


def test_more_free_in_the_cgroup_than_the_machine_has(tmp_path):
    groups = {"memory/box": v1(64 * GiB, GiB)}
    found = usable_memory(**machine(tmp_path, available_kb=4 * GiB // 1024, cgroup="4:memory:/box\n", groups=groups))
    assert found.usable == 4 * GiB - RESERVE and found.source.startswith("MemAvailable")


def test_a_system_that_says_nothing(tmp_path):
    assert usable_memory(proc=tmp_path / "none", cgroups=tmp_path / "none") is None
    found = usable_memory(**machine(tmp_path, available_kb=RESERVE // 2048))
    assert found.usable == 0  # less than the reserve: nothing left for a model
