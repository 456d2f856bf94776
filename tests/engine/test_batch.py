"""Continuous batching through the engine: many requests share every target pass, and
each reply is what its request gives alone."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from minions_local import Engine
from minions_local.core.errors import RequestError
from minions_local.core.events import DoneEvent, StepEvent, TokenEvent
from minions_local.core.sampling import SamplingParams, processed_probs
from minions_local.speculation.budget import BudgetPolicy
from tests.engine.test_greedy_identity import random_prompts
from tests.helpers.stats import chi2_pvalue
from tests.helpers.tiny_models import hf_greedy


def _engine(fam, dtype="float32", **kw):
    kw.setdefault("budget", 12)
    kw.setdefault("max_depth", 6)
    return Engine.from_pretrained(fam["target"], [fam["close"], "ngram"], dtype=dtype, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_batch_replies_equal_replies_alone(families, dtype):
    fam = families["llama"]
    engine = _engine(fam, dtype)
    prompts = random_prompts(7, 96, seed=5)
    alone = []
    for p in prompts:
        engine.reset()
        alone.append(engine.generate(p, max_new_tokens=30).token_ids)
    minion_passes = []  # the transformers minion's compact passes, by requests sharing each
    decoder = engine.decoder.minions[0].runner.decoder
    forward_parts = decoder.forward_parts
    decoder.forward_parts = lambda parts: minion_passes.append(len(parts)) or forward_parts(parts)
    batch = engine.generate_batch(prompts, max_new_tokens=30, parallel=4)
    assert [g.token_ids for g in batch] == alone
    shared = [s.batch_size for g in batch for s in g.steps]
    assert max(shared) == 4 and sum(s > 1 for s in shared) > len(shared) / 2  # passes really were shared
    assert max(minion_passes) == 4  # the trees grew together (HFMinion.grow_batch)
    if dtype == "float32":  # and they are the target's own greedy replies
        target = AutoModelForCausalLM.from_pretrained(fam["target"]).eval()
        assert alone == [hf_greedy(target, p, 30) for p in prompts]


def test_seeded_batch_replies_repeat_alone(families):
    fam = families["qwen2"]
    engine = _engine(fam)
    prompts = random_prompts(5, 96, seed=9)
    kw = dict(max_new_tokens=20, temperature=0.9, top_k=20, seed=1234)
    alone = [engine.generate(p, **kw).token_ids for p in prompts]
    assert [g.token_ids for g in engine.generate_batch(prompts, parallel=3, **kw)] == alone


def test_sampled_requests_sharing_passes_follow_the_target(families):
    """Unseeded sampling with drawn drafts, four requests per pass: the first two tokens
    of every request follow the target's law (chi-square)."""
    fam = families["llama"]
    engine = _engine(fam, budget=8, max_depth=3, selection="all")
    target = AutoModelForCausalLM.from_pretrained(fam["target"]).eval()
    prompt = [3, 7, 1, 3, 7]
    sp = SamplingParams(0.8, 1.0, 6)
    with torch.no_grad():
        p1 = processed_probs(target(torch.tensor([prompt])).logits[0, -1], sp)
        p2 = processed_probs(target(torch.tensor([prompt + [x] for x in range(96)])).logits[:, -1], sp)
    expected = {(a, b): float(p1[a] * p2[a, b]) for a in range(96) for b in range(96) if float(p1[a] * p2[a, b]) > 0}
    seen, drafted, n = Counter(), 0, 0
    for _ in range(150):
        for g in engine.generate_batch([prompt] * 4, max_new_tokens=2, temperature=0.8, top_k=6, parallel=4):
            assert g.steps[0].regime == "sampled" and g.steps[0].batch_size == 4
            seen[tuple(g.token_ids)] += 1
            drafted += g.steps[0].accepted > 0
            n += 1
    assert drafted > n / 4  # drafts were really accepted, inside shared passes
    assert chi2_pvalue(seen, expected, n) > 1e-3


def test_events_are_tagged_and_ordered(families):
    engine = _engine(families["llama"])
    prompts = random_prompts(3, 96, seed=2)
    texts, done = {}, {}
    last = {}
    for index, event in engine.stream_batch(prompts, max_new_tokens=12, parallel=2):
        assert index not in done, "an event after the request's DoneEvent"
        if isinstance(event, TokenEvent):
            texts[index] = texts.get(index, "") + event.text
            last[index] = "token"
        elif isinstance(event, StepEvent):
            assert last.get(index) == "token"
            last[index] = "step"
        elif isinstance(event, DoneEvent):
            done[index] = event.generation
    assert sorted(done) == [0, 1, 2]
    for i, g in done.items():
        assert texts.get(i, "") == g.text and len(g.token_ids) == 12 and g.finish_reason == "length"


def test_the_conversation_slot_is_left_alone(families):
    engine = _engine(families["llama"])
    first = engine.chat([{"role": "user", "content": "hello there"}], max_new_tokens=8)
    cached = list(engine.decoder.target.cached) if engine.decoder.target.slot == 0 else None
    engine.generate_batch(random_prompts(3, 96, seed=4), max_new_tokens=6)
    engine.decoder.target.use_slot(0)
    assert cached is None or engine.decoder.target.cached == cached
    turn = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.text},
            {"role": "user", "content": "and again"}]
    second = engine.chat(turn, max_new_tokens=8)
    assert second.prefill_seconds >= 0 and len(second.token_ids) == 8


def test_a_bad_request_is_named_before_any_work(families):
    engine = _engine(families["llama"])
    with pytest.raises(RequestError, match="Request 1: "):
        engine.generate_batch([[5, 6], [5, 10_000], [7]], max_new_tokens=4)
    with pytest.raises(RequestError, match="parallel"):
        engine.generate_batch([[5, 6]], max_new_tokens=4, parallel=0)
    assert engine.generate_batch([[5, 6]], max_new_tokens=3)[0].token_ids  # the engine is free again


def test_cancel_ends_every_request(families):
    engine = _engine(families["llama"])
    finishes = {}
    for index, event in engine.stream_batch(random_prompts(5, 96, seed=3), max_new_tokens=40, parallel=2):
        if isinstance(event, StepEvent) and index == 0:
            engine.cancel()
        if isinstance(event, DoneEvent):
            finishes[index] = event.generation.finish_reason
    assert sorted(finishes) == list(range(5)) and finishes[4] == "cancelled"
    assert engine.generate([5, 6], max_new_tokens=3).token_ids


def test_a_newcomers_prompt_rides_along_in_the_running_requests_passes(families):
    """A request that joins while others decode reads its prompt inside their passes
    (no pass of its own), and its reply is still what it gives alone."""
    engine = _engine(families["llama"])
    short = random_prompts(2, 96, seed=8)
    long = [int(t) for t in torch.randint(3, 96, (60,), generator=torch.Generator().manual_seed(1))]
    prompts = [*short, long]
    alone = []
    for p in prompts:
        engine.reset()
        alone.append(engine.generate(p, max_new_tokens=24).token_ids)
    engine.reset()  # else the conversation's cache would lend the newcomer its whole prompt
    run = engine.batch_run(3)
    first = [run.admit(engine.prepare(p, max_new_tokens=24), i) for i, p in enumerate(short)]
    events = run.step() + run.step()  # the two short prompts are read, then decoded
    newcomer = run.admit(engine.prepare(long, max_new_tokens=24), 2)
    events += run.step()  # the newcomer's prompt rides along in the others' pass
    rides = [e.record for r, e in events if isinstance(e, StepEvent) and r in first and e.record.pass_rows >= 59]
    assert rides and not newcomer.reply.steps and newcomer.prefilled
    while run.running:
        events += run.step()
    done = {r.tag: e.generation.token_ids for r, e in events if isinstance(e, DoneEvent)}
    assert [done[i] for i in range(3)] == alone
    run.close()


def test_a_prompt_its_slot_already_holds_needs_no_pass(families):
    """The same prompt again takes the slot that holds it (a conversation's next turn
    does this too): nothing is left to read, and it decodes at once."""
    engine = _engine(families["llama"])
    prompt = random_prompts(1, 96, seed=12)[0]
    run = engine.batch_run(1)
    first = run.admit(engine.prepare(prompt, max_new_tokens=6))
    while run.running:
        run.step()
    again = run.admit(engine.prepare(prompt, max_new_tokens=6))
    assert again.slot == first.slot
    events = run.step()  # no pass: the prompt is in the cache already
    assert not events and again.prefilled and run.passes == len(first.reply.steps) + 1
    while run.running:
        events += run.step()
    assert again.reply.out.ids == first.reply.out.ids
    run.close()


class _TreesFrom(BudgetPolicy):
    """A policy that gives no tree until step `start`, then a fixed one."""

    def __init__(self, start: int) -> None:
        self.calls, self.start = 0, start

    def choose(self, remaining_tokens: int, regime: str = "greedy"):
        from minions_local.speculation.budget import FixedBudget

        self.calls += 1
        return FixedBudget(nodes=4 if self.calls > self.start else 0, depth=3).choose(remaining_tokens, regime)

    def observe(self, record) -> None:
        pass


@pytest.mark.parametrize("start", [10**9, 6])
def test_the_minions_read_a_batch_prompt_only_once_it_gets_a_tree(families, monkeypatch, start):
    """Where no tree pays (16 requests on a compute-bound CPU), reading every prompt
    into the minions is time lost: a batch request's minions read its context at its
    first tree, and never if none comes. Replies stay what they are alone."""
    engine = _engine(families["llama"])
    prompts = random_prompts(3, 96, seed=21)
    alone = []
    for p in prompts:
        engine.reset()
        alone.append(engine.generate(p, max_new_tokens=12).token_ids)
    reads = []
    close = engine.decoder.minions[0]
    monkeypatch.setattr(close, "prefill", lambda context, _orig=close.prefill: (reads.append(len(context)),
                                                                               _orig(context))[1])
    monkeypatch.setattr(close, "prefill_batch", lambda requests, _orig=close.prefill_batch: (
        reads.extend(len(context) for _, context in requests), _orig(requests))[1])
    engine.decoder.policy = _TreesFrom(start)
    batch = engine.generate_batch(prompts, max_new_tokens=12, parallel=3)
    assert [g.token_ids for g in batch] == alone
    trees = [s.tree_size for g in batch for s in g.steps]
    if start > 100:
        assert reads == [] and not any(trees)
    else:
        # each request read once, at its first tree: its prompt and the tokens decoded till then
        assert len(reads) == 3, reads
        assert all(n > length for n, length in zip(sorted(reads), sorted(map(len, prompts)))), (reads, prompts)
        assert any(trees)
