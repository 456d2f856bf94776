"""Conversations on disk: one JSON file each under the XDG data dir, written atomically.

A conversation's id is its file name (`<id>.json`), never a value read from inside a
file: a copied file is a conversation of its own, and no file can point a save
elsewhere. Ids are checked before they become paths, so a query or a file name
cannot leave the folder. A file that cannot be read as a conversation (damaged,
truncated, or valid JSON of another shape) is reported by name and left as it is;
no message about one quotes its text.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import stat
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from minions_local.core.errors import MinionsError

FORMAT_VERSION = 1
ROLES = ("user", "assistant")
MAX_FILE_BYTES = 64 << 20
"""Far more than any context window's worth of text; a bigger file is not ours."""

ID_PATTERN = re.compile(r"[^./\\:*?\"<>|\x00-\x1f\x7f][^/\\:*?\"<>|\x00-\x1f\x7f]{0,119}")
"""One file name: no folder separator, no leading dot (hidden and temporary files, '..'),
no control characters, nothing Windows forbids; a copy's 'name (copy)' is fine."""


def default_data_dir() -> Path:
    """`$XDG_DATA_HOME/minions-local/conversations` (platformdirs decides per OS)."""
    import platformdirs

    return Path(platformdirs.user_data_dir("minions-local", appauthor=False)) / "conversations"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def new_id() -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(4)}"


def is_valid_id(text: str) -> bool:
    return isinstance(text, str) and ID_PATTERN.fullmatch(text) is not None and is_unicode(text)


def is_unicode(text: str) -> bool:
    """False for lone surrogates (what undecodable bytes become): they cannot be written as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class ConversationFileError(MinionsError):
    """A saved conversation file that cannot be used; it is named and left untouched."""

    def __init__(self, path: Path, reason: str, mtime: float = 0.0) -> None:
        super().__init__(f"{path} could not be loaded: {reason}. The file is kept as it is; "
                         f"fix it or move it out of {path.parent}.")
        self.path = path
        self.reason = reason
        self.mtime = mtime


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

    def unanswered(self) -> str | None:
        """Take back a last question that got no reply (the app stopped mid-reply): it
        is saved before the reply starts, and sending it again asks it once."""
        if self.messages and self.messages[-1]["role"] == "user":
            return self.messages.pop()["content"]
        return None


@dataclass
class Scan:
    """What the folder holds: the readable conversations and the files that are not,
    each newest first (by the file's modification time)."""

    conversations: list[Conversation] = field(default_factory=list)
    problems: list[ConversationFileError] = field(default_factory=list)
    mtimes: dict[str, float] = field(default_factory=dict)
    """When each readable conversation's file was last written, by id."""

    def problems_newer_than(self, conversation: Conversation | None) -> list[ConversationFileError]:
        if conversation is None:
            return list(self.problems)
        return [p for p in self.problems if p.mtime >= self.mtimes.get(conversation.id, 0.0)]


class ConversationStore:
    """A folder of `<id>.json` files."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_data_dir()

    def path(self, conversation_id: str) -> Path:
        if not is_valid_id(conversation_id):
            raise MinionsError(f"{conversation_id!r:.80} is not a conversation id (a file name in {self.root}, "
                               "without folders or a leading dot).")
        return self.root / f"{conversation_id}.json"

    def save(self, conversation: Conversation) -> Path:
        """Write atomically: a temporary file in the same folder, then `os.replace`."""
        target = self.path(conversation.id)
        conversation.updated = _now()
        data = {"version": FORMAT_VERSION, **asdict(conversation)}
        try:
            payload = json.dumps(data, ensure_ascii=False, indent=1).encode("utf-8")
        except (UnicodeEncodeError, TypeError, ValueError) as err:  # a lone surrogate from a mis-decoded input
            raise MinionsError(f"The conversation was not saved to {target}: part of its text is not valid "
                               f"Unicode ({type(err).__name__}). Retype the last message.") from None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=self.root)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(payload)
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
            ) from None
        return target

    def load(self, conversation_id: str) -> Conversation:
        """The conversation saved as `<id>.json`; ConversationFileError names a file
        that is damaged or of another shape (and leaves it alone)."""
        path = self.path(conversation_id)
        try:
            info = path.stat()
        except FileNotFoundError:
            raise MinionsError(
                f"No saved conversation '{conversation_id}' in {self.root}. "
                "Use /load without an argument to pick one."
            ) from None
        except OSError as err:
            raise ConversationFileError(path, f"it cannot be read ({err.strerror or type(err).__name__})") from None
        conversation = Conversation(**_fields(_read_json(path, info), path, info.st_mtime))
        conversation.id = conversation_id
        return conversation

    def scan(self) -> Scan:
        """Every `*.json` file in the folder, read; none is changed."""
        scan = Scan()
        if not self.root.is_dir():
            return scan
        for path in self.root.glob("*.json"):
            if path.name.startswith("."):
                continue  # temporary files of a save in progress
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue  # gone since the listing
            if not is_valid_id(path.stem):
                scan.problems.append(ConversationFileError(
                    path, "its name cannot be a conversation id (it has characters such as ':' or '?' or is too "
                          "long); rename the file", mtime))
                continue
            try:
                scan.conversations.append(self.load(path.stem))
            except ConversationFileError as err:
                scan.problems.append(err)
            except MinionsError:
                continue  # removed since the listing
            else:
                scan.mtimes[path.stem] = mtime
        scan.conversations.sort(key=lambda c: (scan.mtimes[c.id], c.id), reverse=True)
        scan.problems.sort(key=lambda p: (p.mtime, p.path.name), reverse=True)
        return scan

    def saved(self) -> list[Conversation]:
        """Saved conversations, most recently written first (unreadable files: see `scan`)."""
        return self.scan().conversations

    def find(self, query: str) -> Conversation:
        """By id, by position in `saved()` (1 = newest), or by a unique title prefix."""
        query = query.strip()
        if is_valid_id(query) and self.path(query).exists():
            return self.load(query)
        saved = self.saved()
        if query.isdecimal() and 1 <= int(query) <= len(saved):
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

    def latest_readable(self) -> tuple[Conversation | None, list[ConversationFileError]]:
        """The newest conversation that can be read, and the newer files that could not
        (so that `--resume` can say which it skipped)."""
        scan = self.scan()
        newest = scan.conversations[0] if scan.conversations else None
        return newest, scan.problems_newer_than(newest)


def skipped_note(skipped: list[ConversationFileError], resumed: Conversation | None) -> str:
    """What `--resume` says about newer files it could not read (no text from them)."""
    if not skipped:
        return ""
    first = skipped[0]
    more = f" (and {len(skipped) - 1} more unreadable files)" if len(skipped) > 1 else ""
    then = (f"resumed '{resumed.display_title()}' ({resumed.id}) instead" if resumed is not None
            else "starting a new conversation")
    return (f"Skipped the newest saved conversation, {first.path}{more}: {first.reason}; {then}. "
            f"The file is kept as it is.")


def _read_json(path: Path, info: os.stat_result) -> Any:
    if not stat.S_ISREG(info.st_mode):
        raise ConversationFileError(path, "it is not a regular file", info.st_mtime)
    if info.st_size > MAX_FILE_BYTES:
        raise ConversationFileError(path, f"it is {info.st_size} bytes, too large to be a conversation",
                                    info.st_mtime)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConversationFileError(path, f"it cannot be read ({err.strerror or type(err).__name__})",
                                    info.st_mtime) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConversationFileError(path, f"it is not UTF-8 text (byte {err.start})", info.st_mtime) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        ends_early = err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated")
        cut = " (it ends early: a write was cut short)" if ends_early else ""
        raise ConversationFileError(path, f"it is not valid JSON: {err.msg} at line {err.lineno} column "
                                          f"{err.colno}{cut}", info.st_mtime) from None
    except (ValueError, RecursionError) as err:  # a 5000-digit number, nesting deeper than Python recurses
        raise ConversationFileError(path, f"it is not JSON that can be read ({type(err).__name__})",
                                    info.st_mtime) from None


def _fields(data: Any, path: Path, mtime: float) -> dict[str, Any]:
    """A conversation's fields from a file's JSON, checked; the id is not among them."""

    def wrong(reason: str) -> ConversationFileError:
        return ConversationFileError(path, f"it is not a conversation: {reason}", mtime)

    if not isinstance(data, dict):
        raise wrong(f"the top level is {_kind(data)}, not an object")
    version = data.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION or isinstance(version, bool):
        newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
        raise ConversationFileError(
            path, f"it was written by a newer minions-local (format {version}; this one reads format "
                  f"{FORMAT_VERSION})" if newer else "its 'version' is not a format this program knows", mtime)
    if "messages" not in data:
        raise wrong("it has no 'messages'")
    fields: dict[str, Any] = {"messages": _messages(data["messages"], wrong)}
    for name in ("title", "profile", "system", "created", "updated"):
        if name in data:
            value = data[name]
            if not isinstance(value, str) or not is_unicode(value):
                raise wrong(f"'{name}' is {_kind(value)}, not text")
            fields[name] = value
    if "temperature" in data:
        t = data["temperature"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and 0 <= t <= 2):
            raise wrong("'temperature' is not a number from 0 to 2")
        fields["temperature"] = float(t)
    if "max_new_tokens" in data:
        n = data["max_new_tokens"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1_000_000:
            raise wrong("'max_new_tokens' is not a whole number from 1 to 1000000")
        fields["max_new_tokens"] = n
    return fields


def _messages(value: Any, wrong) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise wrong(f"'messages' is {_kind(value)}, not a list")
    clean = []
    for i, message in enumerate(value, start=1):
        if not isinstance(message, dict):
            raise wrong(f"message {i} is {_kind(message)}, not an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise wrong(f"message {i} has no role 'user' or 'assistant'")
        if not isinstance(content, str) or not is_unicode(content):
            raise wrong(f"message {i} has no text 'content'")
        clean.append({"role": role, "content": content})
    return clean


def _kind(value: Any) -> str:
    """The JSON type of a value, in words (never the value: it may be conversation text)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "text" if is_unicode(value) else "text that is not valid Unicode"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
