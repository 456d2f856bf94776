"""The engine on a GGUF target run by llama.cpp: greedy replies through trees and batches
are the target's own, sampling follows its law, chat turns reuse the cache."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.gguf


@pytest.fixture(scope="module")
def gguf_family(families, tmp_path_factory):
    """The tiny Llama family's target as a Q8_0 GGUF (close enough to the HF weights for
    the family's minions to be accepted), with those minions."""
    from tests.helpers.tiny_gguf import write_gguf

    fam = families["llama"]
    path = write_gguf(fam["target"], tmp_path_factory.mktemp("gguf_family") / "target.gguf", "Q8_0",
                      embedding_type="Q8_0")
    return path, fam


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIONS_CACHE_DIR", str(tmp_path / "cache"))


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 96, int(rng.integers(2, 30)))] for _ in range(n)]


def test_greedy_through_trees_is_the_targets_own(gguf_family):
    from minions_local import Engine
    from minions_local.backends.llama_target import LlamaTarget

    path, fam = gguf_family
    alone = Engine.from_pretrained(path, [])
    engine = Engine.from_pretrained(path, [fam["close"], fam["shallow"], "ngram"], budget=24, max_depth=8)
    assert isinstance(engine.decoder.target, LlamaTarget)
    accepted = []
    for prompt in prompts(6, seed=1):
        alone.reset()
        want = alone.generate(prompt, max_new_tokens=40).token_ids
        got = engine.generate(prompt, max_new_tokens=40)
        assert got.token_ids == want
        accepted += [s.accepted for s in got.steps]
    assert max(accepted) >= 3 and sum(accepted) / len(accepted) > 1.0  # the trees were really used


def test_a_batch_of_requests_gets_each_its_own_reply(gguf_family):
    from minions_local import Engine

    path, fam = gguf_family
    alone = Engine.from_pretrained(path, [])
    engine = Engine.from_pretrained(path, [fam["close"], "ngram"], budget=12, max_depth=6)
    batch = prompts(6, seed=2)
    batch[3] = batch[0] + [5, 6]  # one request extends another's prompt: its prefix is borrowed
    want = []
    for p in batch:
        alone.reset()
        want.append(alone.generate(p, max_new_tokens=24).token_ids)
    got = engine.generate_batch(batch, max_new_tokens=24, parallel=4)
    assert [g.token_ids for g in got] == want


def test_chat_turns_read_only_their_new_tokens(gguf_family):
    from minions_local import Engine

    path, fam = gguf_family
    engine = Engine.from_pretrained(path, [fam["close"]], budget=8)
    alone = Engine.from_pretrained(path, [])
    first = prompts(1, seed=3)[0]
    reply = engine.generate(first, max_new_tokens=20).token_ids
    second = first + reply + [7, 8, 9]
    passes_before = engine.decoder.target.passes
    got = engine.generate(second, max_new_tokens=12)
    alone.reset()
    assert got.token_ids == alone.generate(second, max_new_tokens=12).token_ids
    # The reply's entries stayed: the new turn's prompt needed no pass beyond its decoding.
    assert engine.decoder.target.passes - passes_before <= len(got.steps) + 1


def test_sampling_follows_the_targets_law(gguf_family, monkeypatch):
    """Two sampled tokens, drafts drawn by a close minion: their joint frequencies match
    the law computed from the llama.cpp target's own logits (chi-square)."""
    import minions_local.engine.reply as reply_module
    from minions_local import Engine
    from minions_local.core.sampling import SamplingParams
    from tests.helpers.stats import chi2_pvalue, first_two_tokens, two_token_law

    stream = iter(range(10**6))  # unseeded requests draw their drafts: made repeatable here
    monkeypatch.setattr(reply_module.random, "getrandbits", lambda bits: next(stream))
    path, fam = gguf_family
    engine = Engine.from_pretrained(path, [fam["close"]], budget=6, max_depth=3, selection="all")
    prompt = [1, 5, 9, 22, 40, 3]
    sp = SamplingParams(1.0, 1.0, 4)
    expected = two_token_law(engine.decoder.target, prompt, sp)
    engine.reset()
    observed, drafted = first_two_tokens(engine, prompt, 600, temperature=1.0, top_k=4)
    assert drafted > 100  # the minion's drafts served many first steps
    assert chi2_pvalue(observed, expected, 600) > 1e-3
