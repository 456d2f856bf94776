"""Continuous batching: several requests decode together, sharing every target pass.

A streamed target's pass costs its reads, nearly whatever rows it runs, so k requests
whose trees share a pass pay about what one pays alone (speculation/decode.py
`step_shared`, backends/compact.py `forward_parts`). Requests join and leave between
passes. Each holds a slot (core/slots.py): its own KV cache in the target and its own
caches in every minion, so its reply is exactly what it would be alone.

Slots 1..n belong to batches; slot 0 stays the engine's conversation, which a batch
never touches. A finished request's slot keeps its caches: the next request takes the
free slot whose cache shares the longest prefix with its prompt, so a conversation's
next turn through the server reads only its new tokens.

The caller owns the engine while a BatchRun runs (Engine.stream_batch holds its lock;
the server's scheduler is its only user).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Iterator

import torch

from minions_local.core.errors import GenerationCancelled
from minions_local.core.events import DoneEvent, Event, Generation, TokenEvent
from minions_local.core.protocols import PromptChunk, common_prefix_len
from minions_local.engine.reply import PreparedRequest, Reply, request_generator
from minions_local.speculation.lanes import StepRequest


class Stage(Enum):
    """Where a request of a run stands: the target reads its prompt chunk by chunk,
    riding other requests' passes, then it decodes."""

    JOINED = "joined"
    """Nobody has looked at what its slot's target cache holds of its prompt yet."""
    FIRST_CHUNK = "its first prompt chunk next"
    """Its next prompt chunk is its first (the minions may read its prompt beside that
    pass: Decoder.step_shared's `shadow`)."""
    READING = "reading its prompt"
    DECODING = "decoding"
    """Its prompt is in every model's cache: it decodes from the next pass on."""


@dataclass(eq=False)
class BatchRequest:
    """One request in a batch: its reply, its slot and its timings."""

    tag: Any
    """The caller's name for it (an index, a job)."""
    prepared: PreparedRequest
    reply: Reply
    generator: torch.Generator
    slot: int = 0
    joined_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    cancelled: bool = False
    stage: Stage = Stage.JOINED
    unread: list[int] = field(default_factory=list)
    """Prompt tokens the target has yet to read (once the stage is past JOINED)."""

    @property
    def prefilled(self) -> bool:
        """Its prompt is in every model's cache."""
        return self.stage is Stage.DECODING

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.joined_at


class SlotPool:
    """The slots a run's requests take (a batch's 1..n; the conversation's 0). A free
    slot keeps what its last request left in the caches; a new request takes the free
    slot that shares the longest prefix with its prompt."""

    def __init__(self, slots: Iterable[int]) -> None:
        self.free: dict[int, list[int]] = {slot: [] for slot in slots}
        if not self.free:
            raise ValueError("a run needs at least one slot")

    def __len__(self) -> int:
        return len(self.free)

    def take(self, prompt: list[int]) -> int:
        slot = max(self.free, key=lambda s: (common_prefix_len(self.free[s], prompt), -s))
        del self.free[slot]
        return slot

    def give_back(self, slot: int, context: list[int]) -> None:
        """`context`: what the slot's caches now hold (empty after a failure)."""
        self.free[slot] = list(context)


class BatchRun:
    """Requests decoding together on one engine, one shared target pass per `step`:
    the one decode loop, for a batch job, the server and a lone `Engine.stream` (a run
    of one on the conversation's slot)."""

    def __init__(self, engine, parallel: int, longest: int | None = None, *, conversation: bool = False) -> None:
        """longest: the most tokens (prompt and reply) a request of this batch may hold
        (None: not known ahead, as for a server's requests yet to come).
        conversation: one request at a time on slot 0, the engine's conversation, whose
        caches outlive the run (a chat's next turn reads only its new tokens)."""
        self.engine = engine
        self.decoder = engine.decoder
        self.parallel = 1 if conversation else parallel
        self.owns_slots = not conversation
        self.defer_minion_reads = self.parallel > 1
        """The minions read a request's prompt when it first gets a tree, not with the
        prompt: among many requests trees may not pay at all (16 requests on a
        compute-bound CPU), and then reading 16 prompts into the minions is time lost.
        Alone, they read it beside the target's first chunk on a core to spare, else
        right after the target (or after the first step, for a long one)."""
        self.pool = SlotPool([0] if conversation else range(1, parallel + 1))
        if self.owns_slots:
            self.decoder.expect_requests(parallel, longest)
        self.running: list[BatchRequest] = []
        self.passes = 0

    @property
    def has_room(self) -> bool:
        return len(self.running) < self.parallel

    def admit(self, prepared: PreparedRequest, tag: Any = None) -> BatchRequest:
        """Queue a checked request to join at the next step (its prompt is read then)."""
        if not self.has_room:
            raise RuntimeError("the batch is full: admit only while has_room")
        req = BatchRequest(tag, prepared, Reply(prepared, self.engine.tokenizer, self.engine.eos_ids),
                           request_generator(prepared.seed))
        req.slot = self.pool.take(prepared.ids)
        self.running.append(req)
        return req

    def cancel(self, req: BatchRequest) -> None:
        """End `req` at the next step boundary (its DoneEvent says "cancelled")."""
        req.cancelled = True

    def step(self) -> list[tuple[BatchRequest, Event]]:
        """One shared pass: every decoding request's tree, and newcomers' prompt chunks
        riding along (`prompt_chunks`); returns each request's events in order, and
        finished requests leave the batch.
        On an error every running request's caches may be half-written: they are
        dropped, the requests leave, and the error propagates (each caller fails its
        requests; nothing else is lost)."""
        events: list[tuple[BatchRequest, Event]] = []
        for req in [r for r in self.running if r.cancelled]:
            events += self._finish(req, "cancelled")
        decoding = [r for r in self.running if r.stage is Stage.DECODING]
        try:
            chunks, reading = self.prompt_chunks(busy=bool(decoding))
            results = []
            if decoding or chunks:  # (a newcomer whose slot holds its whole prompt needs no pass)
                steps = [StepRequest(r.reply.context, r.prepared.params, r.generator, r.reply.remaining,
                                     r.prepared.seed is not None, r.slot) for r in decoding]
                starting = [(r.slot, r.reply.context) for r in reading if r.stage is Stage.FIRST_CHUNK]
                results = self.decoder.step_shared(steps, chunks, shadow=[] if self.defer_minion_reads else starting)
            for req in reading:
                req.stage = Stage.READING
                if not req.unread:  # its prompt is in the target: it decodes next
                    self.decoder.prefill_minions(req.reply.context, req.slot, until_a_tree=self.defer_minion_reads)
                    req.stage = Stage.DECODING
                    req.reply.prefill_seconds = time.perf_counter() - req.joined_at
        except BaseException:
            for req in self.running:
                self.decoder.release(req.slot)
                self.pool.give_back(req.slot, [])
            self.running = []
            raise
        self.passes += bool(decoding or chunks)
        now = time.perf_counter()
        for req, result in zip(decoding, results):
            self.engine.keep_tree(result)
            if req.first_token_at is None:
                req.first_token_at = now
            events += [(req, e) for e in req.reply.add(result.tokens, result.record)]
            if req.reply.finish is not None:
                events += self._finish(req)
        return events

    PROMPT_CHUNK = 512
    """Prompt tokens a newcomer reads per pass at most (a prompt's entries are the same
    bits in any chunking: backends/tiled_attention.py)."""

    def prompt_chunks(self, busy: bool) -> tuple[list[PromptChunk], list[BatchRequest]]:
        """The newcomers' prompt pieces for this pass (prefill riding along): each
        request still reading gets its next piece while the pass's budget lasts (one
        piece's worth when others decode, so that their pass stays short, the last
        piece cut to what is left; all that wait when nobody decodes). Returns the
        chunks and the requests they belong to."""
        chunks, reading, budget = [], [], self.PROMPT_CHUNK if busy else None
        for req in self.running:
            if req.stage is Stage.DECODING:
                continue
            if req.stage is Stage.JOINED:
                self.decoder.target.use_slot(req.slot)
                req.unread = self.decoder.target.missing_prompt(req.reply.context)
                req.stage = Stage.FIRST_CHUNK if req.unread else Stage.READING
            piece = req.unread[:self.PROMPT_CHUNK if budget is None else min(self.PROMPT_CHUNK, budget)]
            if req.unread and not piece:
                continue  # the pass is full: the next one reads it
            reading.append(req)
            if piece:
                chunks.append(PromptChunk(req.slot, piece))
                req.unread = req.unread[len(piece):]
                if budget is not None:
                    budget -= len(piece)
        return chunks, reading

    def _finish(self, req: BatchRequest, finish: str | None = None) -> list[tuple[BatchRequest, Event]]:
        self.running.remove(req)
        if req.stage is Stage.DECODING:
            # The target keeps only the prompt's entries: the reference for any later
            # request is the target reading its whole prompt from an empty cache, and a
            # prompt's entries are the same bits however it is chunked
            # (tiled_attention.py), but not a decoding pass's (float64 attention over a
            # tree). A chat's next turn re-reads this reply: one more prompt chunk.
            self.decoder.use_slot(req.slot)
            self.decoder.target.forget_beyond(req.prepared.ids)
        self.pool.give_back(req.slot, req.prepared.ids[:-1] if req.stage is Stage.DECODING else [])
        return [(req, e) for e in req.reply.close(finish)]

    def close(self) -> None:
        """The run is over: a request still running ends (its caches keep only its
        prompt's entries, as a finished one's), and a batch frees its slots' caches; the
        conversation's stay for its next turn."""
        try:
            for req in list(self.running):
                self._finish(req, "cancelled")
        finally:
            self.running = []
            if self.owns_slots:
                for slot in list(self.pool.free):
                    self.decoder.release(slot)


class BatchProgress:
    """A progress bar on stderr for a long batch job: requests done, tokens, tok/s."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="req", desc="batch", file=sys.stderr, dynamic_ncols=True)
        self.tokens = 0
        self.start = time.perf_counter()

    def update(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.tokens += len(event.token_ids)
        elif isinstance(event, DoneEvent):
            rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
            self.bar.set_postfix_str(f"{self.tokens} tokens, {rate:.1f} tok/s", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def run_requests(engine, prepared: list[PreparedRequest], parallel: int, *, conversation: bool = False,
                 progress: bool = False, holder: Any = None) -> Iterator[tuple[int, Event]]:
    """Engine.stream's and stream_batch's loop: holds the engine, admits the requests in
    order as slots free up, and yields (request index, event). Engine.cancel() ends
    every request at the next pass (the ones not started yet get an empty, cancelled
    reply). conversation: one request on the engine's conversation slot. holder: the
    stream this loop runs in (Engine.holding)."""
    with engine.holding("start a generation" if conversation else "start a batch", holder):
        longest = max((len(p.ids) + p.max_new for p in prepared), default=None)
        run = BatchRun(engine, min(parallel, max(1, len(prepared))), longest, conversation=conversation)
        bar = BatchProgress(len(prepared)) if progress else None
        try:
            waiting = list(enumerate(prepared))
            while waiting or run.running:
                while waiting and run.has_room:
                    index, req = waiting.pop(0)
                    run.admit(req, index)
                if engine.cancel_requested:
                    for req in run.running:
                        run.cancel(req)
                    for index, req in waiting:
                        for event in Reply(req, engine.tokenizer, engine.eos_ids).close("cancelled"):
                            yield index, event
                    waiting = []
                for req, event in run.step():
                    if bar is not None:
                        bar.update(event)
                    yield req.tag, event
        finally:
            run.close()
            if bar is not None:
                bar.close()


def collect(events: Iterator[tuple[int, Event]], count: int) -> list[Generation]:
    """Every request's Generation, in input order."""
    results: list[Generation | None] = [None] * count
    for index, event in events:
        if isinstance(event, DoneEvent):
            results[index] = event.generation
    missing = [i for i, g in enumerate(results) if g is None]
    if missing:
        raise GenerationCancelled(f"the batch ended without results for requests {missing}")
    return results  # type: ignore[return-value]
