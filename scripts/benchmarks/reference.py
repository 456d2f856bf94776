"""The reference a reply is held to, and a profile copy to measure it on.

A greedy reply is exact when it equals what the target alone gives reading that
conversation from an empty cache (README "What exact means"): `reference_replies`
computes those; `profile_copy` gives a shipped profile another compute dtype, and, for
a test, an offload folder of its own instead of the user's cache.
"""

from __future__ import annotations

import re
from pathlib import Path


def profile_copy(profile: str, folder: Path, *, dtype: str | None = None, disk_path: Path | None = None) -> str:
    """`profile` itself when nothing changes, else a copy in `folder` whose target
    computes in `dtype` and streams into `disk_path`."""
    if dtype is None and disk_path is None:
        return profile
    from minions_local.profile.loader import find_profile_file

    text = find_profile_file(profile).read_text()
    if dtype is not None:
        text, n = re.subn(r'(?m)^dtype\s*=\s*"[^"]*"', f'dtype = "{dtype}"', text, count=1)
        if not n:
            text = text.replace("[target]\n", f'[target]\ndtype = "{dtype}"\n', 1)
    if disk_path is not None:
        text = re.sub(r'(?m)^disk_path\s*=\s*"[^"]*"', f'disk_path = "{disk_path}"', text)
    path = folder / f"{Path(profile).stem}-{dtype or 'profile'}.toml"
    path.write_text(text)
    return str(path)


def reference_replies(profile: str, chats: list[list[dict]], max_new: int) -> list[str]:
    """Each chat's greedy reply from the target alone, each from an empty cache."""
    from minions_local import Engine

    engine = Engine.from_profile(profile, minions=[])
    replies = []
    for chat in chats:
        engine.reset()
        replies.append(engine.chat(chat, max_new_tokens=max_new, temperature=0).text)
    return replies
