"""A deterministic stand-in for `minions_local.engine.Engine` (no torch, no weights).

It follows the engine's stream contract: `TokenEvent`s and `StepEvent`s (with
verified trees), then one `DoneEvent`; closing the generator early stops it.
Timings in the records are fixed, so every number the TUI shows is reproducible.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from minions_local.core.events import (
    DoneEvent,
    Generation,
    LoadProgress,
    StepEvent,
    StepRecord,
    TokenEvent,
    TreeSnapshot,
)

MINIONS = ["tiny-a", "tiny-b", "ngram"]
REPLY = (
    "Here is a function that adds two numbers:\n\n"
    "```python\ndef add(a, b):\n    return a + b\n```\n\n"
    "It works for **ints** and floats."
)
COMPLETION = "a, b):\n    return a + b\n"
PLAN = (
    "target   fake-1B   bf16   2.0 GB   device 0.2 GB · ram 0.8 GB · disk 1.0 GB\n"
    "minions  tiny-a 60 MB (device) · tiny-b 45 MB (device) · ngram 0 B\n"
    "budget   device 0.4 / 0.5 GB · ram 0.8 / 16.0 GB"
)
MEMORY = {"device": 305_000_000, "ram": 800_000_000, "disk": 1_000_000_000}
LOAD_STEPS = [
    ("target", "device", 200_000_000),
    ("target", "ram", 800_000_000),
    ("target", "disk", 1_000_000_000),
    ("tiny-a", "device", 60_000_000),
    ("tiny-b", "device", 45_000_000),
]


def pieces(text: str) -> list[str]:
    """Word-ish tokens: each keeps its leading whitespace."""
    return re.findall(r"\s*\S+|\s+", text)


class FakeEngine:
    def __init__(
        self,
        *,
        reply: str = REPLY,
        completion: str = COMPLETION,
        profile_name: str = "fake-demo",
        minion_names: list[str] | None = None,
        gate_after: int | None = None,
        fail_after: int | None = None,
        fail_with: Exception | None = None,
        pass_delay: float = 0.0,
    ) -> None:
        self.pass_delay = pass_delay
        """Seconds each fake target pass takes (0 in tests; >0 to watch it stream)."""
        self.reply = reply
        self.completion = completion
        self.profile_name = profile_name
        self.minion_names = list(MINIONS if minion_names is None else minion_names)
        self.gate_after = gate_after
        """After this many passes the stream waits until `gate` is set."""
        self.gate = threading.Event()
        self.waiting = threading.Event()
        """Set while the stream waits at the gate (i.e. inside a 'target pass')."""
        self.fail_after = fail_after
        self.fail_with = fail_with
        self.calls: list[dict[str, Any]] = []
        self.resets = 0
        self.closed_early = 0
        self.notices: list[str] = []
        """What take_notices hands the next request (a real engine: a reload after an RPC
        server was lost)."""

    def memory_plan_text(self) -> str:
        return PLAN

    def memory_by_tier(self) -> dict[str, int]:
        """The device tier grows 1 MB per generation, like a KV cache."""
        memory = dict(MEMORY)
        memory["device"] += 1_000_000 * len(self.calls)
        return memory

    def reset(self) -> None:
        self.resets += 1

    def stream_chat(self, messages: list[dict[str, str]], **kwargs: Any) -> Iterator[Any]:
        self.calls.append({"messages": [dict(m) for m in messages], **kwargs})
        return self._run(self.reply, kwargs.get("max_new_tokens", 256))

    def stream(self, prompt: str, **kwargs: Any) -> Iterator[Any]:
        self.calls.append({"prompt": prompt, **kwargs})
        return self._run(self.completion, kwargs.get("max_new_tokens", 256))

    # --- the batch contract the server's scheduler uses (engine/batch.py) --------------

    def prepare_chat(self, messages: list[dict[str, str]], **kwargs: Any) -> FakeRequest:
        self.calls.append({"messages": [dict(m) for m in messages], **kwargs})
        return FakeRequest(self.reply, kwargs.get("max_new_tokens", 256))

    def prepare(self, prompt: str, **kwargs: Any) -> FakeRequest:
        self.calls.append({"prompt": prompt, **kwargs})
        return FakeRequest(self.completion, kwargs.get("max_new_tokens", 256))

    def default_parallel(self) -> int:
        return 4

    def take_notices(self) -> list[str]:
        notices, self.notices = self.notices, []
        return notices

    def batch_run(self, parallel: int) -> FakeBatch:
        return FakeBatch(self, parallel)

    def _run(self, text: str, max_new_tokens: int) -> Iterator[Any]:
        words = pieces(text)
        cut = len(words) > max_new_tokens
        words = words[:max_new_tokens]
        steps: list[StepRecord] = []
        done = 0
        finished = False
        try:
            while done < len(words):
                n = len(steps)
                if self.gate_after is not None and n == self.gate_after:
                    self.waiting.set()
                    self.gate.wait(10)
                if self.pass_delay:
                    time.sleep(self.pass_delay)
                if self.fail_after is not None and n == self.fail_after:
                    raise self.fail_with or RuntimeError("fake failure")
                chunk = words[done : done + 1 + n % 4]
                prev = words[done - 1] if done else "<s>"
                record = self._record(n, prev, chunk)
                steps.append(record)
                ids = list(range(done, done + len(chunk)))
                done += len(chunk)
                yield TokenEvent(ids, "".join(chunk))
                yield StepEvent(record)
            yield DoneEvent(
                Generation(
                    token_ids=list(range(done)),
                    text="".join(words),
                    steps=steps,
                    finish_reason="length" if cut else "stop",
                    prompt_tokens=12,
                    prefill_seconds=0.05,
                )
            )
            finished = True
        finally:
            if not finished:
                self.closed_early += 1

    def _record(self, n: int, prev: str, chunk: list[str]) -> StepRecord:
        """A tree whose accepted path is chunk[:-1], with one rejected sibling per depth;
        chunk[-1] is the target's bonus token."""
        accepted = chunk[:-1]
        texts, parents, proposers, scores = [prev], [-1], [[]], [1.0]
        path = [0]
        parent = 0
        for depth, word in enumerate(accepted + ["~"]):
            alt = len(texts)
            texts.append(f" alt{depth}")
            parents.append(parent)
            proposers.append([MINIONS[(n + depth + 1) % 3]])
            scores.append(round(0.3 / (depth + 1), 3))
            if word == "~":
                break
            node = alt + 1
            texts.append(word)
            parents.append(parent)
            proposers.append(MINIONS[: 1 + (n + depth) % 3])
            scores.append(round(0.9 ** (depth + 1), 3))
            path.append(node)
            parent = node
        tree = TreeSnapshot(
            tokens=list(range(len(texts))),
            parents=parents,
            texts=texts,
            proposers=proposers,
            scores=scores,
            accepted_path=path,
            bonus_text=chunk[-1],
        )
        k = len(accepted)
        return StepRecord(
            tree_size=len(texts) - 1,
            accepted=k,
            t_grow=0.004,
            t_verify=0.020,
            bytes_streamed=40_000_000,
            depth=k + 1,
            new_tokens=len(chunk),
            minion_accepted={"tiny-a": k, "tiny-b": k // 2, "ngram": k if n % 3 == 0 else 0},
            minion_weights={"tiny-a": 0.5, "tiny-b": 0.3, "ngram": 0.2},
            predicted_t_verify=0.018,
            predicted_t_grow=0.005,
            tree=tree,
        )


@dataclass
class FakeRequest:
    text: str
    max_new_tokens: int


@dataclass(eq=False)
class FakeBatchRequest:
    tag: Any
    events: Iterator[Any]
    cancelled: bool = False


class FakeBatch:
    """BatchRun's contract over the fake's streams: each step is one pass of every
    running request (gates and failures happen inside it, as in a real pass)."""

    def __init__(self, engine: FakeEngine, parallel: int) -> None:
        self.engine = engine
        self.parallel = parallel
        self.running: list[FakeBatchRequest] = []
        self.passes = 0
        self.sizes: list[int] = []
        """Requests in each pass."""

    @property
    def has_room(self) -> bool:
        return len(self.running) < self.parallel

    def admit(self, request: FakeRequest, tag: Any = None) -> FakeBatchRequest:
        req = FakeBatchRequest(tag, self.engine._run(request.text, request.max_new_tokens))
        self.running.append(req)
        return req

    def cancel(self, req: FakeBatchRequest) -> None:
        req.cancelled = True

    def step(self) -> list[tuple[FakeBatchRequest, Any]]:
        out: list[tuple[FakeBatchRequest, Any]] = []
        for req in [r for r in self.running if r.cancelled]:
            self.running.remove(req)
            req.events.close()
            out.append((req, DoneEvent(Generation([], "", [], "cancelled"))))
        if not self.running:
            return out
        self.passes += 1
        self.sizes.append(len(self.running))
        try:
            for req in list(self.running):
                for event in req.events:
                    out.append((req, event))
                    if isinstance(event, DoneEvent):
                        self.running.remove(req)
                        for _ in req.events:  # let the stream end itself (not closed early)
                            pass
                    if isinstance(event, (StepEvent, DoneEvent)):
                        break
        except BaseException:
            for req in self.running:
                req.events.close()
            self.running = []
            raise
        return out


class FakeFactory:
    """Stands in for `Engine.from_profile`: reports load progress, then returns an engine.

    `hold`: while not set, the load keeps reporting progress (for the loading screen);
    `fail`: raised after the progress reports."""

    def __init__(
        self,
        engine: FakeEngine | None = None,
        *,
        fail: Exception | None = None,
        hold: threading.Event | None = None,
    ) -> None:
        self.engine = engine
        self.fail = fail
        self.hold = hold
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, profile: str, *, progress: Any, **overrides: Any) -> FakeEngine:
        self.calls.append((profile, overrides))
        for model, tier, total in LOAD_STEPS:
            if self.hold is not None and (model, tier) == ("target", "disk"):
                continue
            progress(LoadProgress(model, tier, total // 2, total))
            progress(LoadProgress(model, tier, total, total))
        if self.hold is not None:
            partial = LoadProgress("target", "disk", 400_000_000, 1_000_000_000, "placing layer 9 of 24 on disk")
            progress(partial)
            while not self.hold.wait(0.05):
                progress(partial)
        if self.fail is not None:
            raise self.fail
        if self.engine is None:
            self.engine = FakeEngine(profile_name=profile)
        return self.engine
