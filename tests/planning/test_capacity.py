"""How many requests a batch runs at once: as many as their caches fit in the memory free."""

from __future__ import annotations

from minions_local import Engine
from minions_local.planning.capacity import slot_bytes, slots_that_fit


def test_concurrent_requests_are_sized_by_their_caches(families):
    """A slot costs the target's KV cache over the whole context window plus each
    minion's own; the default parallelism is what half the free memory holds (at most 8)."""
    fam = families["llama"]
    engine = Engine.from_pretrained(fam["target"], [fam["close"], "ngram"], dtype="float32")
    target = engine.decoder.target
    minion = engine.minions[0].runner
    expected = (target.kv_bytes_per_token() + minion.kv_bytes_per_token()) * engine.context_length
    assert slot_bytes(target, engine.minions, engine.context_length) == expected > 0
    assert slots_that_fit(target, engine.minions, engine.context_length, free=10 * expected) == 5
    assert slots_that_fit(target, engine.minions, engine.context_length, free=expected) == 1  # never below one
    assert 1 <= engine.default_parallel() <= 8
