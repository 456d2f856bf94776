"""What a step knows of each request it serves, and what the decoder keeps of it
between steps (one Lane per slot: core/slots.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from minions_local.core.protocols import common_prefix_len
from minions_local.core.sampling import SamplingParams


@dataclass
class StepRequest:
    """One request's share of a step: where it stands and how it decodes."""

    context: list[int]
    """Its committed tokens (prompt + reply so far); the last one is the tree's root."""
    params: SamplingParams
    generator: torch.Generator | None
    remaining: int
    """Tokens it may still commit (>= 1)."""
    reproducible: bool = False
    """A seeded request: fixed drafts, so that its tokens depend only on `generator`."""
    slot: int = 0
    """Its state in every model (core/slots.py; 0: the engine's conversation)."""

    @property
    def regime(self) -> str:
        return "greedy" if self.params.greedy else "seeded" if self.reproducible else "sampled"


class PromptRead(Enum):
    """Where the minions stand with a request's prompt."""

    DONE = "read"
    """Their caches hold it (or nothing is waiting)."""
    AFTER_FIRST_STEP = "after the first step"
    """A long prompt: the target gives the first token without a tree, and they read
    it next."""
    BEFORE_NEXT_STEP = "before the next step"
    """The first step has run: they read the prompt before the second."""
    AT_FIRST_TREE = "at its first tree"
    """A batch request: they read it when it first gets a tree, and the target decodes
    it without trees until then (among many requests trees may never pay)."""


@dataclass
class Lane:
    """What the decoder remembers of one slot between steps."""

    prompt: PromptRead = PromptRead.DONE
    """Where the minions stand with the request's prompt (`prefill_minions`)."""
    minions_saw: list[int] = field(default_factory=list)
    """The context the minions' caches were last brought to."""

    def unread(self, context: list[int]) -> int:
        """Tokens of `context` the minions' caches do not hold yet."""
        return len(context) - common_prefix_len(self.minions_saw, context)
