"""The scheduler alone, with a fake engine whose passes wait at a gate: jobs decode
together up to `parallel` (each pass serves all of them), the rest wait in order, the
bound refuses, a cancelled job leaves at the next pass boundary without disturbing the
others, a bad request fails alone, and stopping ends everything."""

import asyncio

import pytest

from minions_local.core.errors import RequestError
from minions_local.core.events import DoneEvent, StepEvent
from minions_local.server.scheduler import Ended, Failed, Job, QueueFull, Scheduler, Started, Stopped
from tests.helpers.fake_engine import FakeEngine


class GatedEngine(FakeEngine):
    """Every pass waits until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__(gate_after=0)
        self.order: list[str] = []
        self.batches = []

    def batch_run(self, parallel):
        batch = super().batch_run(parallel)
        self.batches.append(batch)
        return batch


def job_for(name, engine_order, loop, fail=None, tokens=6):
    def start(engine):
        engine_order.append(name)
        if fail is not None:
            raise fail
        return engine.prepare(name, max_new_tokens=tokens)

    return Job(start=start, loop=loop, name=name)


async def drain(job):
    items = []
    while not items or not isinstance(items[-1], Ended):
        items.append(await asyncio.wait_for(job.next(), 10))
    return items


def run(coro):
    return asyncio.run(coro)


def test_jobs_share_passes_up_to_parallel_and_a_full_queue_refuses():
    async def scenario():
        engine = GatedEngine()
        scheduler = Scheduler(engine, max_waiting=2, parallel=2)
        loop = asyncio.get_running_loop()
        jobs = [job_for(f"job{i}", engine.order, loop) for i in range(4)]
        for job in jobs:
            scheduler.submit(job)
        assert await asyncio.to_thread(engine.waiting.wait, 10)  # job0 and job1 decode, job2 and job3 wait
        with pytest.raises(QueueFull):
            scheduler.submit(job_for("late", engine.order, loop))
        engine.gate.set()
        results = [await drain(job) for job in jobs]
        assert engine.order == ["job0", "job1", "job2", "job3"]  # admitted first come, first served
        for items in results:
            assert isinstance(items[0], Started) and isinstance(items[-2], DoneEvent)
            assert any(isinstance(i, StepEvent) for i in items)
        sizes = engine.batches[0].sizes
        assert sizes[0] == 2 and max(sizes) == 2  # two requests in a pass, never more
        scheduler.stop()
        assert scheduler.join(5)

    run(scenario())


def test_cancelling_a_waiting_job_frees_its_place():
    async def scenario():
        engine = GatedEngine()
        scheduler = Scheduler(engine, max_waiting=1, parallel=1)
        loop = asyncio.get_running_loop()
        running, waiting = job_for("running", engine.order, loop), job_for("waiting", engine.order, loop)
        scheduler.submit(running)
        scheduler.submit(waiting)
        assert await asyncio.to_thread(engine.waiting.wait, 10)
        scheduler.cancel(waiting)
        assert isinstance(await drain(waiting), list)  # it ends at once, never started
        replacement = job_for("replacement", engine.order, loop)
        scheduler.submit(replacement)
        engine.gate.set()
        running_items = await drain(running)
        await drain(replacement)
        assert engine.order == ["running", "replacement"]
        assert running_items[-2].generation.finish_reason != "cancelled"  # the running one untouched
        scheduler.stop()

    run(scenario())


def test_cancelling_a_running_job_ends_it_at_the_pass_boundary_and_spares_the_others():
    async def scenario():
        engine = GatedEngine()
        engine.reply = " ".join(f"w{i}" for i in range(200))
        scheduler = Scheduler(engine, max_waiting=1, parallel=2)
        loop = asyncio.get_running_loop()
        chat = [{"role": "user", "content": "x"}]
        long = Job(start=lambda e: e.prepare_chat(chat, max_new_tokens=200), loop=loop, name="long")
        other = Job(start=lambda e: e.prepare_chat(chat, max_new_tokens=30), loop=loop, name="other")
        scheduler.submit(long)
        scheduler.submit(other)
        assert await asyncio.to_thread(engine.waiting.wait, 10)
        scheduler.cancel(long)
        engine.gate.set()
        items, others = await drain(long), await drain(other)
        assert long.passes == 1 and engine.closed_early == 1
        assert items[-2].generation.finish_reason == "cancelled"
        assert others[-2].generation.finish_reason == "length" and len(others[-2].generation.token_ids) == 30
        scheduler.stop()

    run(scenario())


def test_request_errors_reach_the_job_and_the_others_go_on():
    async def scenario():
        engine = GatedEngine()
        engine.gate.set()
        scheduler = Scheduler(engine, max_waiting=2, parallel=2)
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


def test_a_failing_pass_fails_its_jobs_and_the_worker_goes_on():
    async def scenario():
        engine = GatedEngine()
        engine.gate.set()
        engine.fail_after, engine.fail_with = 1, RuntimeError("pass failed")
        scheduler = Scheduler(engine, max_waiting=2, parallel=2)
        loop = asyncio.get_running_loop()
        jobs = [job_for(f"j{i}", engine.order, loop, tokens=40) for i in range(2)]
        for job in jobs:
            scheduler.submit(job)
        for job in jobs:
            items = await drain(job)
            assert isinstance(items[-2], Failed) and "pass failed" in str(items[-2].error)
        engine.fail_after = None
        # The engine reloaded its target before the next request (an RPC server was lost):
        # that request carries the notice, for its reply, and the log says it.
        engine.notices = ["The target loaded again over this machine and b:2 in 3.1 s"]
        after = job_for("after", engine.order, loop)
        scheduler.submit(after)
        assert isinstance((await drain(after))[-2], DoneEvent)
        assert after.notices == ["The target loaded again over this machine and b:2 in 3.1 s"]
        assert engine.notices == []
        scheduler.stop()

    run(scenario())


def test_stop_fails_the_waiting_and_ends_the_running():
    async def scenario():
        engine = GatedEngine()
        scheduler = Scheduler(engine, max_waiting=2, parallel=1)
        loop = asyncio.get_running_loop()
        running, waiting = job_for("running", engine.order, loop), job_for("waiting", engine.order, loop)
        scheduler.submit(running)
        scheduler.submit(waiting)
        assert await asyncio.to_thread(engine.waiting.wait, 10)
        scheduler.stop()
        waiting_items = await drain(waiting)
        assert isinstance(waiting_items[0], Failed) and isinstance(waiting_items[0].error, Stopped)
        engine.gate.set()
        running_items = await drain(running)
        assert running_items[-2].generation.finish_reason == "cancelled" and engine.order == ["running"]
        with pytest.raises(Stopped):
            scheduler.submit(job_for("after", engine.order, loop))
        assert scheduler.join(5)

    run(scenario())


def test_an_idle_scheduler_takes_one_job_even_with_no_queue():
    async def scenario():
        engine = GatedEngine()
        engine.gate.set()
        scheduler = Scheduler(engine, max_waiting=0, parallel=1)
        job = job_for("only", engine.order, asyncio.get_running_loop())
        scheduler.submit(job)
        assert isinstance((await drain(job))[-2], DoneEvent)
        scheduler.stop()

    run(scenario())


def test_worker_thread_is_a_daemon():
    scheduler = Scheduler(GatedEngine(), max_waiting=1)
    assert scheduler.parallel == 4  # the engine's default
    assert scheduler._worker.daemon and scheduler._worker.name == "minions-serve-engine"
    scheduler.stop()
    assert scheduler.join(5)
