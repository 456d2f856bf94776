"""Conversations on disk: one JSON file each under the XDG data dir, written atomically."""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from minions_local.core.errors import MinionsError

FORMAT_VERSION = 1


def default_data_dir() -> Path:
    """`$XDG_DATA_HOME/minions-local/conversations` (platformdirs decides per OS)."""
    import platformdirs

    return Path(platformdirs.user_data_dir("minions-local", appauthor=False)) / "conversations"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def new_id() -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(2)}"


@dataclass
class Conversation:
    """What a chat is: its messages and the settings it was held with."""

    id: str = field(default_factory=new_id)
    title: str = ""
    profile: str = ""
    system: str = ""
    temperature: float = 0.0
    max_new_tokens: int = 256
    messages: list[dict[str, str]] = field(default_factory=list)
    created: str = field(default_factory=_now)
    updated: str = field(default_factory=_now)

    def engine_messages(self) -> list[dict[str, str]]:
        """The message list for `Engine.stream_chat`, system prompt first."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.messages]

    def display_title(self) -> str:
        if self.title:
            return self.title
        for message in self.messages:
            if message["role"] == "user":
                first = message["content"].strip().splitlines()[0] if message["content"].strip() else ""
                return first[:60] + ("…" if len(first) > 60 else "")
        return "(empty)"


class ConversationStore:
    """A folder of `<id>.json` files."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_data_dir()

    def path(self, conversation_id: str) -> Path:
        return self.root / f"{conversation_id}.json"

    def save(self, conversation: Conversation) -> Path:
        """Write atomically: a temporary file in the same folder, then `os.replace`."""
        conversation.updated = _now()
        data = {"version": FORMAT_VERSION, **asdict(conversation)}
        target = self.path(conversation.id)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=self.root)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(data, f, ensure_ascii=False, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as err:
            raise MinionsError(
                f"Could not save the conversation to {target}: {err.strerror or err}. "
                "Check that the folder is writable and the disk is not full."
            ) from err
        return target

    def load(self, conversation_id: str) -> Conversation:
        path = self.path(conversation_id)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as err:
            raise MinionsError(
                f"No saved conversation '{conversation_id}' in {self.root}. "
                "Use /load without an argument to pick one."
            ) from err
        except (OSError, ValueError) as err:
            raise MinionsError(f"Could not read {path}: {err}. The file may be damaged.") from err
        data.pop("version", None)
        known = Conversation.__dataclass_fields__
        conversation = Conversation(**{k: v for k, v in data.items() if k in known})
        conversation.messages = [
            {"role": str(m["role"]), "content": str(m["content"])}
            for m in conversation.messages
            if isinstance(m, dict) and "role" in m and "content" in m
        ]
        return conversation

    def saved(self) -> list[Conversation]:
        """Saved conversations, most recently updated first (unreadable files skipped)."""
        found = []
        if not self.root.is_dir():
            return found
        for path in self.root.glob("*.json"):
            if path.name.startswith("."):
                continue
            try:
                found.append(self.load(path.stem))
            except MinionsError:
                continue
        found.sort(key=lambda c: (c.updated, c.id), reverse=True)
        return found

    def find(self, query: str) -> Conversation:
        """By id, by position in `saved()` (1 = newest), or by a unique title prefix."""
        query = query.strip()
        if self.path(query).exists():
            return self.load(query)
        saved = self.saved()
        if query.isdigit() and 1 <= int(query) <= len(saved):
            return saved[int(query) - 1]
        matches = [c for c in saved if c.display_title().lower().startswith(query.lower())]
        matches = matches or [c for c in saved if c.id.startswith(query)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise MinionsError(f"No saved conversation matches '{query}'. /load alone lists them.")
        raise MinionsError(
            f"'{query}' matches {len(matches)} conversations; give more of the title or the id."
        )

    def latest(self) -> Conversation | None:
        saved = self.saved()
        return saved[0] if saved else None
