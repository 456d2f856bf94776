"""Slash commands: parsing and validation, kept apart from the app so they test alone."""

from __future__ import annotations

from dataclasses import dataclass

HELP = """\
| command | what it does |
|---|---|
| `/help` | this list |
| `/new` | start a new conversation (the current one stays saved) |
| `/save [title]` | save now, optionally under a title |
| `/load [n\\|title\\|id]` | reload a saved conversation (alone: pick from a list) |
| `/profile [name\\|path]` | show the profile, or load another one |
| `/temp 0.7` | sampling temperature (0 = greedy) |
| `/max 512` | most new tokens per reply |
| `/system [text\\|off]` | show, set or clear the system prompt |
| `/stats` | totals of this session and the memory plan |
| `/copy` | copy the last reply to the clipboard |
| `/raw [lang\\|off]` | replies as plain text (highlighted as *lang*), off = Markdown |
| `/tree` | show or hide the last verified token tree |
| `/quit` | leave |

**Keys:** Enter sends · Ctrl+J (or Alt+Enter) adds a line · a line ending in `\\` continues ·
↑/↓ browse history · PgUp/PgDn scroll · Esc or Ctrl+C stops a reply · Ctrl+T tree · F2 stats ·
Ctrl+C copies selected text · Ctrl+C twice or Ctrl+Q quits
"""

NAMES = ("help", "new", "save", "load", "profile", "temp", "max", "system", "stats", "tree", "raw", "copy", "quit")
ALIASES = {"h": "help", "?": "help", "exit": "quit", "q": "quit", "clear": "new", "temperature": "temp"}


class CommandError(ValueError):
    """A command the user mistyped; the message says how to write it."""


@dataclass(frozen=True)
class Command:
    name: str
    arg: str = ""
    value: float | int | None = None
    """The parsed number for /temp and /max."""


def is_command(text: str) -> bool:
    return text.startswith("/") and not text.startswith("//")


def parse_command(text: str) -> Command:
    """Parse `/name arg...`; raises `CommandError` with a usage hint."""
    head, _, arg = text.strip()[1:].partition(" ")
    name = ALIASES.get(head.lower(), head.lower())
    arg = arg.strip()
    if name not in NAMES:
        close = [n for n in NAMES if n.startswith(name[:2])] if name else []
        hint = f" Did you mean /{close[0]}?" if close else ""
        raise CommandError(f"Unknown command /{head}.{hint} Type /help for the list.")
    if name == "temp":
        try:
            value: float | int = float(arg)
        except ValueError:
            raise CommandError("Usage: /temp 0.7 (a number from 0 to 2; 0 is greedy).") from None
        if not 0.0 <= value <= 2.0:
            raise CommandError("Temperature must be between 0 and 2 (0 is greedy).")
        return Command(name, arg, value)
    if name == "max":
        try:
            value = int(arg)
        except ValueError:
            raise CommandError("Usage: /max 512 (the most new tokens per reply).") from None
        if value < 1:
            raise CommandError("/max needs at least 1 token.")
        return Command(name, arg, value)
    return Command(name, arg)
