"""One engine, up to `parallel` requests decoding together, and a bounded FIFO queue.

The engine's passes block (torch work), so they run on one worker thread; the event
loop only queues jobs and reads their events. Each job's events cross to the loop
through `call_soon_threadsafe` into an asyncio queue.

Continuous batching (engine/batch.py): up to `parallel` jobs run at once, and every
target pass serves all of them; between passes, finished jobs leave and waiting ones
join, first come first served. Beyond `parallel` running and `max_waiting` waiting, a
new job is refused at once (the HTTP layer answers 429) instead of piling up without
bound. Cancelling a job (its client went away) takes it out of the queue, or, when it
runs, ends it at the next pass boundary; the others run on. A job's bad request fails
that job alone, before it joins.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minions_local.core.events import DoneEvent, StepEvent

log = logging.getLogger("minions_local.server")

Start = Callable[[Any], Any]
"""`start(engine) -> request`: calls engine.prepare / prepare_chat, which check the
request (a bad one raises before it joins the batch)."""


class QueueFull(Exception):
    pass


class Stopped(Exception):
    """The scheduler is shutting down."""


@dataclass(frozen=True)
class Started:
    """The engine accepted the request (its checks passed); events follow."""


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass(frozen=True)
class Ended:
    """Nothing more will come for this job."""


@dataclass(eq=False)
class Job:
    start: Start
    loop: asyncio.AbstractEventLoop
    name: str = ""
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    passes: int = 0
    notices: list[str] = field(default_factory=list)
    """What happened to the engine just before this job started (a target reloaded after an
    RPC server was lost, and how long that took): logged, and stated in the reply."""

    def put(self, item: Any) -> None:
        """From the worker thread; a closed loop (server gone) cancels the job."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:
            self.cancelled.set()

    async def next(self) -> Any:
        return await self.events.get()

    @property
    def queue_seconds(self) -> float:
        return (self.started_at or time.perf_counter()) - self.queued_at


class Scheduler:
    def __init__(self, engine: Any, *, max_waiting: int, parallel: int | None = None) -> None:
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.engine = engine
        self.max_waiting = max_waiting
        self.parallel = parallel if parallel is not None else engine.default_parallel()
        if self.parallel < 1:
            raise ValueError("parallel must be >= 1")
        self._batch = engine.batch_run(self.parallel)
        self._waiting: deque[Job] = deque()
        self._running: dict[Job, Any] = {}
        """Each running job's request in the batch."""
        self._cond = threading.Condition()
        self._stopped = False
        self._worker = threading.Thread(target=self._work, name="minions-serve-engine", daemon=True)
        self._worker.start()

    # --- from the event loop ----------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopped:
                raise Stopped
            # `parallel` running plus max_waiting waiting, counted the same whether or
            # not the worker has moved the last jobs into the batch yet.
            if len(self._waiting) + len(self._running) >= self.parallel + self.max_waiting:
                raise QueueFull
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job if it waits; if it runs, it leaves the batch
        at the next pass boundary (the worker sees the flag)."""
        job.cancelled.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                job.put(Ended())

    def stop(self) -> None:
        """Refuse new jobs, fail the waiting ones, end the running ones after their pass."""
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            waiting, self._waiting = list(self._waiting), deque()
            for job in self._running:
                job.cancelled.set()
            self._cond.notify_all()
        for job in waiting:
            job.put(Failed(Stopped()))
            job.put(Ended())

    def join(self, timeout: float) -> bool:
        self._worker.join(timeout)
        return not self._worker.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    # --- on the worker thread ---------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._running and not self._stopped:
                    self._cond.wait()
                if self._stopped and not self._running:
                    return
                joining = []
                while self._waiting and len(self._running) + len(joining) < self.parallel:
                    joining.append(self._waiting.popleft())
                for job in joining:
                    self._running[job] = None  # counted as running from here (submit's bound)
            try:
                for job in joining:
                    self._join(job)
                self._step()
            except BaseException as err:  # keep serving: a failure belongs to its jobs
                log.error("the worker failed outside a generation", exc_info=err)

    def _join(self, job: Job) -> None:
        job.started_at = time.perf_counter()
        if job.cancelled.is_set():
            self._leave(job)
            return
        try:
            request = job.start(self.engine)
        except Exception as err:  # the engine refused the request before any work
            job.put(Failed(err))
            self._leave(job)
            return
        for text in self.engine.take_notices():
            log.warning("%s: %s", job.name, text)
            job.notices.append(text)
        job.put(Started())
        self._running[job] = self._batch.admit(request, job)

    def _step(self) -> None:
        for job, request in list(self._running.items()):
            if job.cancelled.is_set() and request is not None:
                self._batch.cancel(request)
        if not self._batch.running:
            return
        try:
            events = self._batch.step()
        except Exception as err:  # the pass failed: every job in it fails (the batch dropped them)
            for job in list(self._running):
                job.put(Failed(err))
                self._leave(job)
            return
        for request, event in events:
            job = request.tag
            job.put(event)
            if isinstance(event, StepEvent):
                job.passes += 1
            elif isinstance(event, DoneEvent):
                g = event.generation
                if g.finish_reason == "cancelled":
                    log.info("%s: cancelled after %d target passes", job.name, job.passes)
                else:
                    sizes = [s.batch_size for s in g.steps] or [0]
                    log.info("%s: %d tokens in %d target passes (%.2f a pass), %.1f tok/s, batch %.1f on average "
                             "(up to %d)", job.name, len(g.token_ids), len(g.steps), g.tokens_per_pass,
                             g.tokens_per_second, sum(sizes) / len(sizes), max(sizes))
                self._leave(job)

    def _leave(self, job: Job) -> None:
        job.put(Ended())
        with self._cond:
            self._running.pop(job, None)
