"""Every message that crosses from a worker thread (or a widget) to the app.

Worker threads only ever call `post_message` with one of these; widgets are touched
on the app's thread alone. High-rate messages say so with `can_replace`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from textual.message import Message

from minions_local.core.events import Generation, LoadProgress, TreeSnapshot
from minions_local.tui.stats import GenerationStats


@dataclass
class LoadProgressed(Message):
    """Weights of one model are loading into one tier."""

    progress: LoadProgress

    def can_replace(self, message: Message) -> bool:
        # Dropped in favour of the next queued update of the same model and tier.
        return (
            isinstance(message, LoadProgressed)
            and message.progress.model == self.progress.model
            and message.progress.tier == self.progress.tier
        )


@dataclass
class EngineReady(Message):
    """The engine finished loading; `plan_text` and `memory` were read on the loader thread."""

    engine: Any
    profile_name: str
    minion_names: list[str]
    plan_text: str
    memory: dict[str, int] = field(default_factory=dict)


@dataclass
class EngineFailed(Message):
    """Loading failed; `message` is written for the user."""

    title: str
    message: str


@dataclass
class ReplyDelta(Message):
    """Text to append to the reply being streamed."""

    text: str


@dataclass
class StatsUpdated(Message):
    """A copy of the running stats after a target pass, and the tree it verified."""

    stats: GenerationStats
    tree: TreeSnapshot | None

    def can_replace(self, message: Message) -> bool:
        # Textual drops this (older) message when the next one queued `can_replace`s it:
        # only the newest numbers matter, but keep a tree if the newer pass has none.
        return isinstance(message, StatsUpdated) and (message.tree is not None or self.tree is None)


@dataclass
class ReplyFinished(Message):
    """The generation thread is done; always the last message it posts."""

    text: str
    reason: str
    """'length', 'stop', 'cancelled' or 'error'."""
    generation: Generation | None = None
    stats: GenerationStats | None = None
    error: str | None = None
    memory: dict[str, int] | None = None
    """Bytes per tier after this reply (KV caches grow), read on the worker thread."""


@dataclass
class PromptSubmitted(Message):
    """The user pressed Enter in the prompt."""

    text: str
