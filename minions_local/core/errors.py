"""Errors a user can act on.

Every error raised across the public API is a `MinionsError` whose message says what
went wrong AND what to do about it. The TUI and CLI print `str(err)` and never a
traceback for these; anything else is a bug.
"""

from __future__ import annotations


class MinionsError(Exception):
    """Base class: the message is written for the user, including the remedy."""


class ModelLoadError(MinionsError):
    """A model folder or file is missing, damaged, or not a supported architecture."""


class VocabularyMismatchError(ModelLoadError):
    """A minion does not share the target's vocabulary, so its drafts cannot be verified."""


class ModelOutputError(MinionsError):
    """The model computed something no token can be chosen from (NaN or infinite logits)."""


class ContextOverflowError(MinionsError):
    """Prompt plus requested new tokens do not fit in the target's context window."""


class ProfileError(MinionsError):
    """A profile is unknown, malformed, or does not fit the machine's memory."""


class MemoryPlanError(MinionsError):
    """The memory budgets cannot hold even the minimum working set."""


class RequestError(MinionsError, ValueError):
    """A generation request that cannot be served as given (bad token ids, bad arguments).

    `argument` names the offending argument ('temperature', 'prompt', ...) when there is
    one, so that a server can point at the field of the request."""

    def __init__(self, message: str, *, argument: str | None = None) -> None:
        super().__init__(message)
        self.argument = argument


class EngineBusyError(MinionsError):
    """The engine is in the middle of a generation and cannot start another or reset."""


class GenerationCancelled(MinionsError):
    """Generation was stopped by the caller; the partial output is kept."""
