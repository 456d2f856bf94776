"""The same request, the same reply, on the real model (SmolLM2), resident and streamed
from disk, in bfloat16 and float32.

A server reuses cached prefixes across requests (every chat shares the template's system
prompt), and reads newcomers' prompts in chunks riding other requests' passes. So a
prompt's cache entries must be the same bits however it was chunked and whatever ran
beside it: random chunkings of a 1500-token prompt (pieces of 1, 7, 64, 512 and the
rest), some pieces sharing their pass with another request's, against the whole prompt
read from an empty cache; and replies equal to the target reading each chat alone."""

from __future__ import annotations

import random

import pytest
import torch

from minions_local.core.protocols import PromptChunk

pytestmark = pytest.mark.realmodel

CONFIGS = [("cpu-demo", "bfloat16"), ("cpu-demo", "float32"), ("cpu-demo-disk", "bfloat16"),
           ("cpu-demo-disk", "float32")]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"{c[0]}-{c[1]}")
def engine(converted, request, tmp_path_factory):
    from minions_local.engine import Engine
    from minions_local.engine.from_profile import engine_kwargs_from_profile

    profile, dtype = request.param
    kwargs = engine_kwargs_from_profile(profile, dtype=dtype, minions=[])
    if "stream_options" in kwargs:
        kwargs["stream_options"] = {**kwargs["stream_options"], "cache_dir": str(tmp_path_factory.mktemp("offload"))}
    return Engine.from_pretrained(**kwargs)


def long_prompt(engine, n: int = 1500) -> list[int]:
    text = " ".join(f"Note {i}: the shipment of {i * 7 % 13} crates reached dock {i % 5} at {i % 12 + 1} pm."
                    for i in range(400))
    ids = engine.encode(text)[:n]
    assert len(ids) == n
    return ids


def entries(target, slot: int, n: int) -> torch.Tensor:
    target.use_slot(slot)
    return target.decoder.slot_kv.kv[:, :, :, :n].clone()


def test_prompt_entries_are_the_same_bits_in_any_chunking(engine):
    target = engine.decoder.target
    prompt = long_prompt(engine)
    other = long_prompt(engine)[::-1]
    target.use_slot(1)
    target.extend(prompt)
    whole = entries(target, 1, len(prompt))
    rng = random.Random(0)
    for trial in range(3):
        target.drop_slot(2)
        target.drop_slot(3)
        done = 0
        while done < len(prompt):
            size = rng.choice([1, 7, 64, 512, len(prompt)])
            piece = prompt[done:done + size]
            if rng.random() < 0.5:  # a co-runner's prompt chunk shares the pass
                side = other[:rng.choice([1, 7, 64, 200])]
                target.verify_batch([], [PromptChunk(2, piece), PromptChunk(3, side)])
                target.drop_slot(3)
            else:
                target.use_slot(2)
                target.extend(piece)
            done += len(piece)
        chunked = entries(target, 2, len(prompt))
        assert torch.equal(chunked, whole), f"trial {trial}: entries differ at " \
            f"{(chunked != whole).nonzero()[:, 3].unique()[:10].tolist()}"
    for slot in (1, 2, 3):
        target.drop_slot(slot)
    target.use_slot(0)


def test_replies_do_not_depend_on_what_ran_before(engine):
    """A chat after an unrelated one reuses the template's cached system prompt; its reply
    is the one it gets from an empty cache, and so is a later turn of it."""
    questions = ["Why is the sky blue? Answer in two sentences.", "Name three primary colors."]
    engine.reset()
    fresh = [engine.chat([{"role": "user", "content": q}], max_new_tokens=24).text for q in questions
             if engine.reset() is None]
    engine.reset()
    engine.chat([{"role": "user", "content": "Write a haiku about trains."}], max_new_tokens=24)
    after = [engine.chat([{"role": "user", "content": q}], max_new_tokens=24).text for q in questions]
    assert after == fresh
    turns = [{"role": "user", "content": questions[0]}, {"role": "assistant", "content": after[0]},
             {"role": "user", "content": "And at sunset?"}]
    later = engine.chat(turns, max_new_tokens=24).text
    engine.reset()
    assert engine.chat(turns, max_new_tokens=24).text == later
