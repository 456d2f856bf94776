"""One generation at a time: what a second caller, a reset() and an abandoned stream get."""

import gc
import threading

import pytest

from minions_local import Engine
from minions_local.core.errors import EngineBusyError, MinionsError
from minions_local.core.events import DoneEvent
from tests.helpers.tiny_models import hf_greedy

PROMPT = [9, 3, 7, 7]
N = 24


@pytest.fixture(scope="module")
def engine(families):
    fam = families["llama"]
    return Engine.from_pretrained(fam["target"], [fam["close"]], budget=4)


@pytest.fixture(scope="module")
def reference(families):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(families["llama"]["target"]).eval()
    return hf_greedy(model, PROMPT, N)


def _held_in_a_step(engine, monkeypatch):
    """Make the next target pass wait inside decoder.step_shared until `release` is set."""
    inside, release = threading.Event(), threading.Event()
    real_step = engine.decoder.step_shared

    def step(*args, **kwargs):
        inside.set()
        assert release.wait(10)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(engine.decoder, "step_shared", step)
    return inside, release


def test_reset_during_a_running_generation_is_refused(engine, reference, monkeypatch):
    inside, release = _held_in_a_step(engine, monkeypatch)
    result = []
    worker = threading.Thread(target=lambda: result.append(engine.generate(PROMPT, max_new_tokens=N)))
    worker.start()
    assert inside.wait(10)
    with pytest.raises(EngineBusyError, match="engine.cancel\\(\\)") as err:
        engine.reset()
    assert "Cannot reset the engine" in str(err.value) and isinstance(err.value, MinionsError)
    release.set()
    worker.join(10)
    assert result[0].token_ids == reference
    monkeypatch.undo()
    engine.reset()  # free again
    assert engine.generate(PROMPT, max_new_tokens=N).token_ids == reference


def test_second_generation_from_another_thread_names_cancel(engine, monkeypatch):
    inside, release = _held_in_a_step(engine, monkeypatch)
    worker = threading.Thread(target=lambda: engine.generate(PROMPT, max_new_tokens=N))
    worker.start()
    assert inside.wait(10)
    try:
        with pytest.raises(EngineBusyError, match="a generation is running .*engine.cancel\\(\\)"):
            engine.generate([5], max_new_tokens=2)
    finally:
        release.set()
        worker.join(10)


def test_paused_stream_message_names_close_and_close_releases(engine, reference):
    stream = engine.stream(PROMPT, max_new_tokens=N)
    next(stream)
    with pytest.raises(EngineBusyError, match="paused.*stream.close\\(\\)"):
        engine.generate(PROMPT, max_new_tokens=N)
    with pytest.raises(EngineBusyError, match="Cannot reset"):
        engine.reset()
    stream.close()
    assert engine.generate(PROMPT, max_new_tokens=N).token_ids == reference


def test_dropped_stream_releases_the_engine(engine, reference):
    stream = engine.stream(PROMPT, max_new_tokens=N)
    next(stream)
    del stream
    assert engine.generate(PROMPT, max_new_tokens=N).token_ids == reference


class _Keeper:
    pass


def test_stream_abandoned_in_a_reference_cycle_is_collected(engine, reference):
    gc.disable()  # the cycle must still be alive when the next generation asks
    try:
        keeper = _Keeper()
        keeper.stream = engine.stream(PROMPT, max_new_tokens=N)
        keeper.myself = keeper
        next(keeper.stream)
        del keeper
        assert engine.generate(PROMPT, max_new_tokens=N).token_ids == reference
    finally:
        gc.enable()


def test_stream_that_was_never_started_holds_nothing(engine, reference):
    unused = engine.stream(PROMPT, max_new_tokens=N)
    assert engine.generate(PROMPT, max_new_tokens=N).token_ids == reference
    events = list(unused)
    assert isinstance(events[-1], DoneEvent) and events[-1].generation.token_ids == reference


def test_cancel_during_a_pass_stops_after_it(engine, monkeypatch):
    inside, release = _held_in_a_step(engine, monkeypatch)
    result = []
    worker = threading.Thread(target=lambda: result.append(engine.generate(PROMPT, max_new_tokens=N)))
    worker.start()
    assert inside.wait(10)
    engine.cancel()
    release.set()
    worker.join(10)
    assert result[0].finish_reason == "cancelled" and len(result[0].steps) == 1
