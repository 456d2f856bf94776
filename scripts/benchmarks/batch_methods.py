"""The ways bench_batch.py serves N concurrent chat requests, each timed the same way.

Every request is submitted at time 0; a method reports, per request, its new tokens,
when its first token came (time to first token, queueing included) and when it was
done. Aggregate tok/s is all new tokens over the wall time until the last is done;
a request's own speed is its tokens over the time from its first token to its last
(how fast its reply streams once it started).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

from minions_local.core.events import DoneEvent, StepRecord, TokenEvent


@dataclass
class RequestTiming:
    tokens: list[int]
    first_token: float
    done: float

    @property
    def tokens_per_second(self) -> float:
        streaming = self.done - self.first_token
        # One token only (or all in one step): its speed is undefined; count it at the wall rate.
        return (len(self.tokens) - 1) / streaming if streaming > 0 and len(self.tokens) > 1 else 0.0


@dataclass
class BatchResult:
    requests: list[RequestTiming]
    wall: float
    steps: list[StepRecord] = field(default_factory=list)
    streamed_bytes: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)

    @property
    def aggregate_tokens_per_second(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0

    @property
    def passes(self) -> float:
        """Target passes: a shared pass appears once in each of its requests' records."""
        return sum(1 / s.batch_size for s in self.steps)

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0

    @property
    def bytes_per_pass(self) -> float:
        return self.streamed_bytes / self.passes if self.passes else 0.0

    def per_request(self) -> dict[str, float]:
        speeds = sorted(r.tokens_per_second for r in self.requests)
        ttft = sorted(r.first_token for r in self.requests)
        return {"median_tok_s": statistics.median(speeds), "p10_tok_s": _percentile(speeds, 0.1),
                "median_ttft_s": statistics.median(ttft), "p90_ttft_s": _percentile(ttft, 0.9)}


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class OneAtATime:
    """Today's serving: the requests in turn, each with the engine's adaptive speculation."""

    def __init__(self, name: str, engine) -> None:
        self.name = name
        self.engine = engine
        engine.decoder.keep_trees = False

    def run(self, prompts: list[list[int]], max_new: int, temperature: float, seed: int) -> BatchResult:
        random.seed(seed)  # the requests' own streams, repeatable (they stay unseeded requests)
        target = self.engine.decoder.target
        streamed = target.bytes_streamed()
        start = time.perf_counter()
        timings, steps = [], []
        for ids in prompts:
            self.engine.reset()  # a cold cache: the requests are different conversations
            first, tokens = None, []
            for event in self.engine.stream(ids, max_new_tokens=max_new, temperature=temperature):
                if isinstance(event, TokenEvent) and first is None:
                    first = time.perf_counter() - start
                if isinstance(event, DoneEvent):
                    tokens = event.generation.token_ids
                    steps += event.generation.steps
            timings.append(RequestTiming(tokens, first or 0.0, time.perf_counter() - start))
        return BatchResult(timings, time.perf_counter() - start, steps, target.bytes_streamed() - streamed)


class Batched:
    """Continuous batching: all N requests decode together (Engine.stream_batch)."""

    def __init__(self, name: str, engine) -> None:
        self.name = name
        self.engine = engine
        engine.decoder.keep_trees = False

    def run(self, prompts: list[list[int]], max_new: int, temperature: float, seed: int) -> BatchResult:
        random.seed(seed)
        target = self.engine.decoder.target
        for slot in range(1, len(prompts) + 1):  # cold caches, as the one-at-a-time runs get
            self.engine.decoder.reset(slot)  # (the slots stay allocated, as a server's do)
        streamed = target.bytes_streamed()
        start = time.perf_counter()
        first: dict[int, float] = {}
        done: dict[int, tuple[list[int], float]] = {}
        steps = []
        for index, event in self.engine.stream_batch(prompts, max_new_tokens=max_new, temperature=temperature,
                                                     parallel=len(prompts), progress=False):
            now = time.perf_counter() - start
            if isinstance(event, TokenEvent):
                first.setdefault(index, now)
            elif isinstance(event, DoneEvent):
                done[index] = (event.generation.token_ids, now)
                steps += event.generation.steps
        timings = [RequestTiming(done[i][0], first.get(i, done[i][1]), done[i][1]) for i in range(len(prompts))]
        return BatchResult(timings, time.perf_counter() - start, steps, target.bytes_streamed() - streamed)

