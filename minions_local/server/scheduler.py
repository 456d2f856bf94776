"""One engine, one generation at a time, and a bounded FIFO queue in front of it.

The engine's passes block (torch work), so they run on one worker thread; the event
loop only queues jobs and reads their events. Each job's events cross to the loop
through `call_soon_threadsafe` into an asyncio queue. A full queue refuses at once
(the HTTP layer answers 429) instead of letting waiting requests pile up without
bound. Cancelling a job (its client went away) takes it out of the queue, or, when
it is the one running, tells the engine to stop after the current target pass.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from minions_local.core.events import DoneEvent, StepEvent

log = logging.getLogger("minions_local.server")

Start = Callable[[Any], Iterator[Any]]
"""`start(engine) -> events`: calls engine.stream / stream_chat (which check the request)."""


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
    def __init__(self, engine: Any, *, max_waiting: int) -> None:
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.engine = engine
        self.max_waiting = max_waiting
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._stopped = False
        self._worker = threading.Thread(target=self._work, name="minions-serve-engine", daemon=True)
        self._worker.start()

    # --- from the event loop ----------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopped:
                raise Stopped
            # One running plus max_waiting, counted the same whether or not the worker
            # has taken the last job off the queue yet.
            if len(self._waiting) + (self._running is not None) > self.max_waiting:
                raise QueueFull
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job if it waits, stop the engine if it runs."""
        job.cancelled.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                return
            if self._running is job:
                # Under the lock: the engine is still on this job, so the flag cannot
                # land on the next one.
                self.engine.cancel()

    def stop(self) -> None:
        """Refuse new jobs, fail the waiting ones, stop the running one after its pass."""
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            waiting, self._waiting = list(self._waiting), deque()
            if self._running is not None:
                self._running.cancelled.set()
                self.engine.cancel()
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

    # --- on the worker thread ---------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                job = self._running = self._waiting.popleft()
            try:
                self._run(job)
            except BaseException as err:  # keep serving: a failure belongs to its job
                log.error("the worker failed outside a generation", exc_info=err)
            finally:
                with self._cond:
                    self._running = None
                job.put(Ended())

    def _run(self, job: Job) -> None:
        job.started_at = time.perf_counter()
        if job.cancelled.is_set():
            return
        try:
            events = job.start(self.engine)
        except Exception as err:  # the engine refused the request before any work
            job.put(Failed(err))
            return
        job.put(Started())
        try:
            for event in events:
                job.put(event)
                if isinstance(event, StepEvent):
                    job.passes += 1
                    # A pass ends with its StepEvent: stop here, within one pass of the cancel.
                    if job.cancelled.is_set():
                        log.info("%s: cancelled after %d target passes", job.name, job.passes)
                        break
                if isinstance(event, DoneEvent) and event.generation.finish_reason == "cancelled":
                    log.info("%s: cancelled after %d target passes", job.name, job.passes)
        except Exception as err:
            job.put(Failed(err))
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()
