"""The shipped demo family: where it lives and whether it is intact.

Each member folder is checked against `manifest.json` (sizes always, sha256 of the
files a model needs) before it is loaded, so a damaged or missing file is named with
the way to restore it instead of surfacing as a deserialisation traceback.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from minions_local.core.errors import ModelLoadError
from minions_local.models.checksum import sha256_of

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo_models"  # minions_local/demo_models
RESTORE = ("Restore it by reinstalling minions-local (pip install --force-reinstall minions-local, or "
           "`git checkout -- minions_local/demo_models` in a clone), or re-create the family with "
           "`python scripts/train_demo_family.py --seed 0`.")


def is_demo_path(path: str | Path) -> bool:
    try:
        Path(path).resolve().relative_to(DEMO_DIR)
    except ValueError:
        return False
    return True


@lru_cache(maxsize=None)
def _manifest() -> dict:
    path = DEMO_DIR / "manifest.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"The demo model family is missing ({path} not found). {RESTORE}") from None
    except ValueError:
        raise ModelLoadError(f"{path} is damaged. {RESTORE}") from None


@lru_cache(maxsize=None)
def verify_member(folder: str) -> None:
    """Raise ModelLoadError naming the first missing or damaged file of a demo member."""
    member = Path(folder).resolve()
    name = member.relative_to(DEMO_DIR).as_posix()
    files = {k: v for k, v in _manifest()["files"].items() if k.startswith(name + "/")}
    if not files:
        raise ModelLoadError(f"{member} is not part of the shipped demo family (no entry in the manifest). "
                             f"{RESTORE}")
    for rel, meta in files.items():
        path = DEMO_DIR / rel
        if not path.is_file():
            raise ModelLoadError(f"The shipped demo file {path} is missing. {RESTORE}")
        if path.stat().st_size != meta["size"] or sha256_of(path) != meta["sha256"]:
            raise ModelLoadError(f"The shipped demo file {path} is damaged (its size or checksum does not "
                                 f"match the manifest). {RESTORE}")
