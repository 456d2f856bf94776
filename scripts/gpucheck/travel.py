"""What travels to the lent GPU machine, and the slim checkout that makes it fit one call.

The device tool copies the checkout's tracked and untracked-not-ignored files (and
shared/), plus up to 8 ignored paths named in `carry`, at most 64 MiB a call, to a
machine with no network. The tracked tree is ~64 MiB, 62 of it the demo family, so a
plain copy does not fit. The check needs the code, the demo target and ONE minion
(chat.MINION), and the wheels the GPU image lacks that the engine's path imports
(pydantic through minions_local.profile, platformdirs through the model cache): the
other minions stay behind.

A tracked file travels whatever .gitignore says, so for the one call the left-behind
minion folders leave the index (`git rm --cached`: the files stay on disk) and are
ignored through .git/info/exclude; `unslim` puts them back. A sparse checkout would
not do: git still lists its skipped files as tracked. While slim, a pre-commit hook
refuses every commit, since a commit then would delete those folders from the repo.

    python scripts/gpu_check.py --manifest   # what would travel, the carry list, the command
    python scripts/gpu_check.py --slim       # wheels into .gpu/wheels, the minions out of the index
    (one device call: the command --slim prints, carry [".gpu/wheels"])
    python scripts/gpu_check.py --unslim     # ALWAYS afterwards
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO = "minions_local/demo_models"
TRAVELLING_MINION = "minion-qwen2-xs"
WHEEL_DIR = ".gpu/wheels"
WHEELS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "platformdirs")
"""typing-extensions travels too: pydantic-core needs a recent one, the image's is of unknown age."""
WHEEL_ALLOWANCE = 3 << 20
"""What the wheels weigh (2.5 MiB measured) where they are not downloaded (CI)."""
LIMIT = 60 << 20
"""The issue's limit: 4 MiB under the tool's 64 MiB, for the files a session adds meanwhile."""
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux1_x86_64")
GPU_PYTHON = "3.12"  # the lent image's python3 (KINDS.md)
TIMEOUT_S = 540
"""The device call's timeout_s: the check's 470 s budget, the wheels' install and imports, a margin."""
GUARD_TAG = "minions-local gpu_check slim guard"


def git(repo: Path, *args: str, check: bool = True) -> str:
    """git in `repo`; a held index lock (someone else committing) is waited out."""
    for attempt in range(20):
        proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
        if proc.returncode == 0 or "index.lock" not in proc.stderr:
            break
        time.sleep(0.5)
    if check and proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def left_behind(repo: Path = REPO) -> list[str]:
    """The demo member folders that do not travel: every one but the target and the minion."""
    root = repo / DEMO
    members = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return [f"{DEMO}/{m}" for m in members if m not in ("target", TRAVELLING_MINION)]


def listed(repo: Path = REPO) -> list[str]:
    """What the tool sends besides `carry`: tracked and untracked-not-ignored files, shared/."""
    names = git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    shared = repo / "shared"
    if shared.is_dir():
        names += [p.relative_to(repo).as_posix() for p in shared.rglob("*") if p.is_file()]
    return sorted({n for n in names if n and (repo / n).is_file()})


def wheels(repo: Path = REPO) -> list[Path]:
    return sorted((repo / WHEEL_DIR).glob("*.whl"))


def manifest(repo: Path = REPO) -> dict:
    """The files that would travel (the left-behind minions subtracted whether or not the
    checkout is slim yet), the wheels (or their allowance), and the total against LIMIT."""
    skip = tuple(p + "/" for p in left_behind(repo))
    files = {n: (repo / n).stat().st_size for n in listed(repo) if not n.startswith(skip)}
    found = {p.relative_to(repo).as_posix(): p.stat().st_size for p in wheels(repo)}
    wheel_bytes = sum(found.values()) if found else WHEEL_ALLOWANCE
    total = sum(files.values()) + wheel_bytes
    groups: dict[str, int] = {}
    for name, size in files.items():
        key = "/".join(name.split("/")[:3]) if name.startswith(DEMO) else name.split("/")[0]
        groups[key] = groups.get(key, 0) + size
    return {"files": files, "wheels": found, "wheel_bytes": wheel_bytes, "wheels_estimated": not found,
            "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1])), "total_bytes": total,
            "limit_bytes": LIMIT, "fits": total <= LIMIT, "left_behind": list(skip), "carry": [WHEEL_DIR]}


def device_command(commit: str) -> str:
    """The one device call's command: install the wheels, then the check (budget 470 s)."""
    return (f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "
            f"{WHEEL_DIR}/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && "
            f"python3 scripts/gpu_check.py --out $OUT --commit {commit}")


def describe(plan: dict, commit: str) -> str:
    mib = lambda b: f"{b / (1 << 20):.2f} MiB"  # noqa: E731
    lines = [f"travels: {mib(plan['total_bytes'])} of {mib(plan['limit_bytes'])} "
             f"({len(plan['files'])} files; wheels {mib(plan['wheel_bytes'])}"
             f"{', estimated: not downloaded yet' if plan['wheels_estimated'] else ''})"]
    lines += [f"  {mib(size):>11}  {name}" for name, size in list(plan["groups"].items())[:8]]
    lines += [f"stays behind: {', '.join(plan['left_behind'])}",
              f"carry: {plan['carry']}   timeout_s: {TIMEOUT_S}",
              f"command: {device_command(commit)}"]
    if not plan["fits"]:
        lines.append("DOES NOT FIT: remove untracked files or shrink what travels")
    return "\n".join(lines)


def download_wheels(repo: Path = REPO) -> list[Path]:
    """The WHEELS in this environment's versions, for the image's Python (pip download)."""
    specs = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    dest = repo / WHEEL_DIR
    dest.mkdir(parents=True, exist_ok=True)
    have = {p.name.split("-")[0].lower().replace("_", "-") + "==" + p.name.split("-")[1] for p in wheels(repo)}
    missing = [s for s in specs if s.lower() not in have]
    if missing:
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", GPU_PYTHON, "--implementation", "cp", *platforms, "-d", str(dest),
                        *missing], check=True)
    return wheels(repo)


def _exclude_file(repo: Path) -> Path:
    return (repo / git(repo, "rev-parse", "--git-path", "info/exclude").strip()).resolve()


def _hook(repo: Path) -> Path:
    hooks = git(repo, "config", "core.hooksPath", check=False).strip() or git(repo, "rev-parse", "--git-path",
                                                                               "hooks").strip()
    return (repo / hooks).resolve() / "pre-commit"


def _marker(repo: Path) -> Path:
    return (repo / git(repo, "rev-parse", "--git-path", "minions-gpu-slim").strip()).resolve()


def is_slim(repo: Path = REPO) -> bool:
    return _marker(repo).exists()


def slim(repo: Path = REPO, *, download: bool = True) -> str:
    """Make the checkout travel as manifest() says: the other minions out of the index."""
    if download:
        download_wheels(repo)
    plan = manifest(repo)
    if not plan["fits"]:
        raise RuntimeError(describe(plan, "HEAD"))
    hook = _hook(repo)
    if hook.exists() and GUARD_TAG not in hook.read_text():
        raise RuntimeError(f"{hook} exists and is not ours: merge a guard into it by hand (see travel.py)")
    paths = plan["left_behind"]
    if git(repo, "diff", "--cached", "--name-only", "--", *paths).strip() and not is_slim(repo):
        raise RuntimeError(f"staged changes under {', '.join(paths)}: commit or unstage them first")
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text("#!/bin/sh\n"
                    f"# {GUARD_TAG}: installed by scripts/gpu_check.py --slim, removed by --unslim.\n"
                    "# While slim, demo minions are out of the index: a commit would delete them.\n"
                    "echo 'refusing to commit: the checkout is slim for a GPU call; "
                    "run: python scripts/gpu_check.py --unslim' >&2\nexit 1\n")
    hook.chmod(0o755)
    _marker(repo).touch()
    tracked = [p for p in paths if git(repo, "ls-files", "--", p).strip()]
    if tracked:
        git(repo, "rm", "-r", "-q", "--cached", "--", *tracked)
    exclude = _exclude_file(repo)
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    wanted = [f"/{p}" for p in paths]  # (.gpu/ itself is in .gitignore)
    exclude.write_text("\n".join(lines + [w for w in wanted if w not in lines]) + "\n")
    leaked = [n for n in listed(repo) if n.startswith(tuple(paths))]
    if leaked:
        raise RuntimeError(f"still listed after slimming: {leaked[:3]}")
    commit = git(repo, "rev-parse", "--short", "HEAD").strip()
    return describe(manifest(repo), commit)


def unslim(repo: Path = REPO) -> str:
    """Put the left-behind minions back in the index, unchanged; commits allowed again."""
    paths = [p + "/" for p in left_behind(repo)]
    if paths:
        git(repo, "reset", "-q", "--", *paths)
    exclude = _exclude_file(repo)
    if exclude.exists():
        drop = {f"/{p}" for p in paths}
        exclude.write_text("".join(line + "\n" for line in exclude.read_text().splitlines() if line not in drop))
    hook = _hook(repo)
    if hook.exists() and GUARD_TAG in hook.read_text():
        hook.unlink()
    _marker(repo).unlink(missing_ok=True)
    dirty = git(repo, "status", "--porcelain", "--", DEMO).strip()
    if dirty:
        raise RuntimeError(f"git status still shows changes under {DEMO}:\n{dirty}")
    return f"unslim: {', '.join(paths) or 'nothing'} back in the index, unchanged; commits allowed again"
