"""One request's reply as it grows, step by step: the same for a lone generation and
for a request in a shared batch.

It takes the decoder's committed tokens, ends the reply at an end-of-sequence token,
a stop string or the token limit, turns tokens into text (holding back what might be
the start of a stop string), and yields the events callers see.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from minions_local.core.events import DoneEvent, Event, Generation, StepEvent, StepRecord, TokenEvent
from minions_local.core.sampling import SamplingParams
from minions_local.engine.text import IncrementalText, find_stop


@dataclass(frozen=True)
class PreparedRequest:
    """A request whose arguments were checked (Engine.prepare): ready to decode."""

    ids: list[int]
    """The prompt's token ids."""
    params: SamplingParams
    max_new: int
    seed: int | None
    stops: list[str]


def request_generator(seed: int | None) -> torch.Generator:
    """A request's randomness: its seed's, or a fresh one."""
    return torch.Generator().manual_seed(seed if seed is not None else random.getrandbits(63))


class Reply:
    """The reply to one request: its context, tokens, text and finish reason."""

    def __init__(self, request: PreparedRequest, tokenizer, eos_ids: set[int]) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.context = list(request.ids)
        self.text = IncrementalText(tokenizer)
        self.out = _Output(request.stops)
        self.steps: list[StepRecord] = []
        self.finish: str | None = None
        """None while it runs; then "stop", "length" or "cancelled"."""
        self.prefill_seconds = 0.0

    @property
    def remaining(self) -> int:
        """Tokens it may still add (>= 1 while it runs)."""
        return self.request.max_new - len(self.out.ids)

    @property
    def stopped_early(self) -> bool:
        """Ended by an end-of-sequence token or a stop string: a step may have accepted
        tokens past the end, which the caches must forget (see Engine)."""
        return self.finish == "stop"

    def add(self, tokens: list[int], record: StepRecord) -> list[Event]:
        """A step committed `tokens` for this request: its TokenEvent and StepEvent."""
        new = tokens
        eos_at = next((i for i, t in enumerate(new) if t in self.eos_ids), None)
        if eos_at is not None:
            new, self.finish = new[: eos_at + 1], "stop"
        self.context.extend(new)
        self.text.push(new)
        delta, hit_stop = self.out.add(new, self.text.text)
        if hit_stop:
            self.finish = "stop"
            # A stop string: the tokens after the one completing it are not kept.
            extra = len(new) - self._tokens_to_stop(self.out.ids[:len(self.out.ids) - len(new)], new)
            if extra:
                del self.context[-extra:], self.out.ids[-extra:]
                new = new[:-extra]
        record.new_tokens = len(new)
        self.steps.append(record)
        if self.finish is None and self.remaining <= 0:
            self.finish = "length"
        return [TokenEvent(new, delta), StepEvent(record)]

    def close(self, finish: str | None = None) -> list[Event]:
        """The reply ends (`finish` overrides a running reply's reason, e.g. "cancelled"):
        the held-back tail of its text, then its DoneEvent."""
        if self.finish is None:
            self.finish = finish or "length"
        events: list[Event] = []
        if self.finish != "stop":
            self.text.flush()
            tail, _ = self.out.add([], self.text.text, final=True)
            if tail:
                events.append(TokenEvent([], tail))
        events.append(DoneEvent(self.generation()))
        return events

    def generation(self) -> Generation:
        return Generation(token_ids=self.out.ids, text=self.out.text, steps=self.steps,
                          finish_reason=self.finish or "length", prompt_tokens=len(self.request.ids),
                          prefill_seconds=self.prefill_seconds)

    def _tokens_to_stop(self, before: list[int], new: list[int]) -> int:
        """How many of a step's `new` tokens it took to complete a stop string."""
        for n in range(1, len(new)):
            if find_stop(self.tokenizer.decode(before + new[:n]), self.request.stops) >= 0:
                return n
        return len(new)


class _Output:
    """The reply as it grows: stop strings end it, and text that might be the start of
    a stop string is held back until it is clear."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.ids: list[int] = []
        self.text = ""
        self._stopped = False

    def add(self, ids: list[int], full_text: str, final: bool = False) -> tuple[str, bool]:
        if self._stopped:
            return "", True
        self.ids.extend(ids)
        cut = find_stop(full_text, self.stops)
        if cut >= 0:
            self._stopped = True
            visible = full_text[:cut]
        elif final:
            visible = full_text
        else:
            visible = full_text[: len(full_text) - _partial_stop(full_text, self.stops)]
        delta = visible[len(self.text):] if len(visible) > len(self.text) else ""
        self.text = max(self.text, visible, key=len)
        return delta, self._stopped


def _partial_stop(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that begins some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best

