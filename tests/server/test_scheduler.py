"""The scheduler alone, with a fake engine whose passes wait at a gate: queue order,
the bound, cancelling a waiting or running job, stopping."""

import asyncio

import pytest

from minions_local.core.errors import RequestError
from minions_local.core.events import DoneEvent, StepEvent
from minions_local.server.scheduler import Ended, Failed, Job, QueueFull, Scheduler, Started, Stopped
from tests.helpers.fake_engine import FakeEngine


class GatedEngine(FakeEngine):
    """Every pass waits until the test opens the gate; cancel() works like the engine's."""

    def __init__(self) -> None:
        super().__init__(gate_after=0)
        self.cancels = 0
        self.order: list[str] = []

    def cancel(self) -> None:
        self.cancels += 1
        self.gate.set()


def job_for(name, engine_order, loop, fail=None):
    def start(engine):
        engine_order.append(name)
        if fail is not None:
            raise fail
        return engine.stream(name, max_new_tokens=6)

    return Job(start=start, loop=loop, name=name)


async def drain(job):
    items = []
    while not items or not isinstance(items[-1], Ended):
        items.append(await asyncio.wait_for(job.next(), 10))
    return items


def run(coro):
    return asyncio.run(coro)


def test_jobs_run_in_order_and_a_full_queue_refuses():
    async def scenario():
        engine = GatedEngine()
        scheduler = Scheduler(engine, max_waiting=2)
        loop = asyncio.get_running_loop()
        jobs = [job_for(f"job{i}", engine.order, loop) for i in range(3)]
        for job in jobs:
            scheduler.submit(job)
        assert await asyncio.to_thread(engine.waiting.wait, 10)  # job0 runs, job1 and job2 wait
        with pytest.raises(QueueFull):
            scheduler.submit(job_for("late", engine.order, loop))
        engine.gate.set()
        results = [await drain(job) for job in jobs]
        assert engine.order == ["job0", "job1", "job2"]
        for items in results:
            assert isinstance(items[0], Started) and isinstance(items[-2], DoneEvent)
            assert any(isinstance(i, StepEvent) for i in items)
        scheduler.stop()
        assert scheduler.join(5)

    run(scenario())


def test_cancelling_a_waiting_job_frees_its_place():
    async def scenario():
        engine = GatedEngine()
        scheduler = Scheduler(engine, max_waiting=1)
        loop = asyncio.get_running_loop()
        running, waiting = job_for("running", engine.order, loop), job_for("waiting", engine.order, loop)
        scheduler.submit(running)
        scheduler.submit(waiting)
        assert await asyncio.to_thread(engine.waiting.wait, 10)
        scheduler.cancel(waiting)
        assert engine.cancels == 0  # a waiting job is dropped, the running one untouched
        replacement = job_for("replacement", engine.order, loop)
        scheduler.submit(replacement)
        engine.gate.set()
        await drain(running)
        await drain(replacement)
        assert engine.order == ["running", "replacement"]
        scheduler.stop()

    run(scenario())


def test_cancelling_the_running_job_stops_it_after_its_pass():
    async def scenario():
        engine = GatedEngine()
        engine.reply = " ".join(f"w{i}" for i in range(200))
        scheduler = Scheduler(engine, max_waiting=1)
        loop = asyncio.get_running_loop()
        job = Job(start=lambda e: e.stream_chat([{"role": "user", "content": "x"}], max_new_tokens=200), loop=loop,
                  name="long")
        scheduler.submit(job)
        assert await asyncio.to_thread(engine.waiting.wait, 10)
        scheduler.cancel(job)
        items = await drain(job)
        assert engine.cancels == 1 and job.passes == 1 and engine.closed_early == 1
        assert not any(isinstance(i, DoneEvent) for i in items)
        scheduler.stop()

    run(scenario())


def test_request_errors_reach_the_job_and_the_worker_goes_on():
    async def scenario():
        engine = GatedEngine()
        engine.gate.set()
        scheduler = Scheduler(engine, max_waiting=2)
        loop = asyncio.get_running_loop()
        bad = job_for("bad", engine.order, loop, fail=RequestError("temperature is bad", argument="temperature"))
        good = job_for("good", engine.order, loop)
        scheduler.submit(bad)
        scheduler.submit(good)
        bad_items, good_items = await drain(bad), await drain(good)
        assert isinstance(bad_items[0], Failed) and bad_items[0].error.argument == "temperature"
        assert isinstance(good_items[-2], DoneEvent)
        scheduler.stop()

    run(scenario())


def test_stop_fails_the_waiting_and_refuses_new_jobs():
    async def scenario():
        engine = GatedEngine()
        scheduler = Scheduler(engine, max_waiting=2)
        loop = asyncio.get_running_loop()
        running, waiting = job_for("running", engine.order, loop), job_for("waiting", engine.order, loop)
        scheduler.submit(running)
        scheduler.submit(waiting)
        assert await asyncio.to_thread(engine.waiting.wait, 10)
        scheduler.stop()
        waiting_items = await drain(waiting)
        assert isinstance(waiting_items[0], Failed) and isinstance(waiting_items[0].error, Stopped)
        await drain(running)
        assert engine.cancels == 1 and engine.order == ["running"]
        with pytest.raises(Stopped):
            scheduler.submit(job_for("after", engine.order, loop))
        assert scheduler.join(5)

    run(scenario())


def test_an_idle_scheduler_takes_one_job_even_with_no_queue():
    async def scenario():
        engine = GatedEngine()
        engine.gate.set()
        scheduler = Scheduler(engine, max_waiting=0)
        job = job_for("only", engine.order, asyncio.get_running_loop())
        scheduler.submit(job)
        assert isinstance((await drain(job))[-2], DoneEvent)
        scheduler.stop()

    run(scenario())


def test_worker_thread_is_a_daemon():
    scheduler = Scheduler(GatedEngine(), max_waiting=1)
    assert scheduler._worker.daemon and scheduler._worker.name == "minions-serve-engine"
    scheduler.stop()
    assert scheduler.join(5)
