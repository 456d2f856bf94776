"""The public API's behaviour: streaming, chat reuse, stops, cancellation, bad input."""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from minions_local import Engine
from minions_local.core.errors import ContextOverflowError, ModelLoadError, VocabularyMismatchError
from minions_local.core.events import DoneEvent, StepEvent, TokenEvent
from tests.helpers.tiny_models import hf_greedy, random_model, save, tiny_config


@pytest.fixture(scope="module")
def engine(families):
    fam = families["llama"]
    return Engine.from_pretrained(fam["target"], [fam["close"], fam["other"]], budget=16)


@pytest.fixture(scope="module")
def reference(families):
    return AutoModelForCausalLM.from_pretrained(families["llama"]["target"]).eval()


def test_stream_events_and_records(engine):
    events = list(engine.stream([4, 5, 6], max_new_tokens=20))
    assert isinstance(events[-1], DoneEvent)
    gen = events[-1].generation
    tokens = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
    records = [e.record for e in events if isinstance(e, StepEvent)]
    assert tokens == gen.token_ids and records == gen.steps
    assert sum(r.new_tokens for r in records) == len(gen.token_ids)
    for r in records:
        assert r.accepted <= r.tree_size and r.t_grow >= 0 and r.t_verify > 0
        assert r.tree is not None and r.tree.accepted_path[0] == 0 and len(r.tree.accepted_path) == r.accepted + 1
        assert set(r.minion_accepted) == {"llama-close", "llama-other"}
        assert set(r.minion_t_grow) == set(r.minion_weights) and sum(r.minion_t_grow.values()) <= r.t_grow


def test_closing_stream_early_leaves_engine_usable(engine, reference):
    prompt = [7, 3, 9, 9]
    stream = engine.stream(prompt, max_new_tokens=30)
    first = next(e for e in stream if isinstance(e, TokenEvent))
    stream.close()
    assert first.token_ids == hf_greedy(reference, prompt, 30)[: len(first.token_ids)]
    assert engine.generate(prompt, max_new_tokens=30).token_ids == hf_greedy(reference, prompt, 30)


def test_prompt_extending_previous_reuses_the_cache(engine, reference):
    prompt = [11, 12, 13, 14, 15]
    first = engine.generate(prompt, max_new_tokens=10).token_ids
    ran = []
    original = engine.decoder.target.extend
    engine.decoder.target.extend = lambda toks, **kw: ran.append(len(toks)) or original(toks, **kw)
    try:
        second_prompt = prompt + first + [20, 21]
        out = engine.generate(second_prompt, max_new_tokens=10).token_ids
    finally:
        del engine.decoder.target.extend
    assert out == hf_greedy(reference, second_prompt, 10)
    # The reply is re-read as prompt (the cache keeps prompt entries only: BatchRun._finish),
    # the first prompt is not.
    assert sum(ran) <= len(first) + 3, f"earlier tokens were re-run: prefill lengths {ran}"


def test_chat_uses_template_and_reuses_turns(families, tokenizer):
    fam = families["llama"]
    engine = Engine.from_pretrained(fam["target"], [fam["close"]])
    messages = [{"role": "user", "content": "def add(a, b):"}]
    reply = engine.chat(messages, max_new_tokens=8)
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                  add_special_tokens=False)
    assert reply.prompt_tokens == len(prompt_ids)
    messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "hello"}]
    cached_before = len(engine.decoder.target.cached)
    reply2 = engine.chat(messages, max_new_tokens=8)
    assert reply2.prefill_seconds >= 0 and cached_before > len(prompt_ids) // 2
    assert len(reply2.token_ids) > 0


def test_stop_strings_cut_the_text(engine):
    full = engine.generate("hello", max_new_tokens=30)
    assert len(full.text) > 4
    stop = full.text[2:4]
    out = engine.generate("hello", max_new_tokens=30, stop=[stop])
    assert out.finish_reason == "stop" and stop not in out.text
    assert full.text.startswith(out.text) and len(out.text) <= full.text.find(stop)


def test_context_overflow_is_refused_before_any_work(engine):
    with pytest.raises(ContextOverflowError, match="context window of 256"):
        engine.generate([5] * 200, max_new_tokens=100)
    assert engine.generate([5, 6], max_new_tokens=3).finish_reason in ("length", "stop")


def test_interrupted_step_leaves_engine_correct(families, reference):
    fam = families["llama"]
    engine = Engine.from_pretrained(fam["target"], [fam["close"]])
    minion = engine.minions[0]
    real_grow = minion.grow
    calls = {"n": 0}

    def flaky(context, budget):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_grow(context, budget)

    minion.grow = flaky
    prompt = [9, 8, 7]
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompt, max_new_tokens=40)
    assert engine.generate(prompt, max_new_tokens=40).token_ids == hf_greedy(reference, prompt, 40)


def test_cancel_from_another_thread(engine):
    events = []
    stream = engine.stream([1, 2, 3], max_new_tokens=200)
    for event in stream:
        events.append(event)
        if isinstance(event, StepEvent) and len(events) == 2:
            threading.Thread(target=engine.cancel).start()
            threading.Event().wait(0.05)
    assert events[-1].generation.finish_reason in ("cancelled", "stop")


def test_vocabulary_mismatch_names_both(tmp_path, families):
    odd = save(random_model(tiny_config("llama", vocab=80), 1), tmp_path / "odd-minion")
    with pytest.raises(VocabularyMismatchError) as err:
        Engine.from_pretrained(families["llama"]["target"], [odd])
    msg = str(err.value)
    assert "odd-minion" in msg and "llama-target" in msg and "80" in msg and "60" in msg


def test_missing_and_corrupt_models_have_remedies(tmp_path, families):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "nowhere", [])
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in families["llama"]["target"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="damaged or incomplete"):
        Engine.from_pretrained(broken, [])


def test_text_prompt_roundtrip(engine):
    out = engine.generate("def add(a, b):", max_new_tokens=12)
    assert isinstance(out.text, str) and len(out.token_ids) >= 1
    assert out.text == engine.decode([t for t in out.token_ids if t not in engine.eos_ids])


def test_bad_requests_are_user_errors(engine):
    from minions_local.core.errors import MinionsError

    with pytest.raises(MinionsError, match="outside the target's vocabulary"):
        engine.generate([5, 10_000], max_new_tokens=3)
    with pytest.raises(MinionsError, match="top_p"):
        engine.generate([5], max_new_tokens=3, temperature=1.0, top_p=0.0)


def test_tokenizer_larger_than_model_is_refused(tmp_path, tokenizer):
    from tests.helpers.tiny_models import random_model, save, tiny_config

    small = save(random_model(tiny_config("llama", vocab=40), 0), tmp_path / "small", tokenizer)
    with pytest.raises(ModelLoadError, match="do not belong together"):
        Engine.from_pretrained(small, [])
