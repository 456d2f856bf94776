"""The n-gram (prompt lookup) minion: proposals, tree shape, index consistency."""

from __future__ import annotations

import math
import random

import pytest

from minions_local.core.protocols import GrowBudget, Minion
from minions_local.backends.ngram import ContextIndex, CorpusIndex, NGramMinion
from minions_local.core.errors import ModelLoadError


def assert_valid_tree(tree, budget):
    assert len(tree) <= budget.max_nodes and tree.depth() <= budget.max_depth
    seen = set()
    for i, (token, parent, lp) in enumerate(zip(tree.tokens, tree.parents, tree.logprobs)):
        assert -1 <= parent < i
        assert lp < 0 and math.isfinite(lp)
        if parent >= 0:
            assert lp <= tree.logprobs[parent]
        assert (parent, token) not in seen
        seen.add((parent, token))


def best_chain(tree):
    """The most probable path, following the best child at each level."""
    chain, node = [], -1
    while True:
        kids = [i for i, p in enumerate(tree.parents) if p == node]
        if not kids:
            return chain
        node = max(kids, key=lambda i: tree.logprobs[i])
        chain.append(tree.tokens[node])


def test_is_a_minion():
    minion = NGramMinion()
    assert isinstance(minion, Minion) and minion.vocab_size == 0 and minion.name == "ngram"


def test_proposes_the_continuation_of_repeated_text():
    sentence = [10, 11, 12, 13, 14, 15, 16, 17]
    context = [1, 2] + sentence + [3, 4, 5] + sentence[:3]
    budget = GrowBudget(max_nodes=16, max_depth=5)
    tree = NGramMinion().grow(context, budget)
    assert_valid_tree(tree, budget)
    assert best_chain(tree)[:5] == [13, 14, 15, 16, 17]
    # Scores follow the measured hit rate of an n-token match, about n / (n + 2.5) on
    # Python sources, and grow along the path as the match lengthens.
    assert tree.tokens[0] == 13 and tree.logprobs[0] == pytest.approx(math.log(3 / 5.5))
    assert tree.logprobs[1] - tree.logprobs[0] == pytest.approx(math.log(4 / 6.5))


def test_branches_where_continuations_differ():
    context = [5, 6, 7, 1, 9, 5, 6, 7, 2, 9, 9, 5, 6, 7]
    budget = GrowBudget(max_nodes=10, max_depth=4)
    tree = NGramMinion().grow(context, budget)
    assert_valid_tree(tree, budget)
    roots = {tree.tokens[i]: tree.logprobs[i] for i in range(len(tree)) if tree.parents[i] == -1}
    assert {1, 2} <= set(roots)
    assert roots[2] > roots[1]  # the more recent occurrence counts a little more


def test_longer_matches_outweigh_short_ones():
    # "6 7 8 9" -> 4 once (a 4-token match); "9" alone -> 3 twice (1-token matches)
    context = [9, 3, 9, 3, 6, 7, 8, 9, 4, 1, 6, 7, 8, 9]
    tree = NGramMinion().grow(context, GrowBudget(8, 2))
    assert tree.tokens[0] == 4


def test_budget_is_respected_and_empty_when_nothing_matches():
    minion = NGramMinion()
    context = list(range(50)) * 3
    for nodes, depth in [(1, 1), (5, 2), (40, 12), (3, 30)]:
        budget = GrowBudget(nodes, depth)
        tree = minion.grow(context, budget)
        assert len(tree) == min(nodes, depth) or len(tree) == nodes
        assert_valid_tree(tree, budget)
    assert len(minion.grow([1, 2, 3, 4], GrowBudget(8, 4))) == 0  # nothing repeats yet
    assert len(minion.grow([7], GrowBudget(8, 4))) == 0
    assert len(minion.grow(context, GrowBudget(0, 4))) == 0


def test_index_follows_rollbacks_and_new_turns():
    rng = random.Random(0)
    minion, budget = NGramMinion(max_match=4), GrowBudget(12, 4, top_k=3)
    context = [rng.randrange(6) for _ in range(30)]
    for _ in range(40):
        action = rng.random()
        if action < 0.5:
            context = context + [rng.randrange(6) for _ in range(rng.randint(1, 4))]
        elif action < 0.8:
            context = context[:rng.randint(1, len(context))]
        else:
            cut = rng.randint(1, len(context))
            context = context[:cut] + [rng.randrange(6) for _ in range(5)]
        got = minion.grow(context, budget)
        want = NGramMinion(max_match=4).grow(context, budget)
        assert (got.tokens, got.parents) == (want.tokens, want.parents)
        assert got.logprobs == pytest.approx(want.logprobs)
    minion.reset()
    assert minion.grow(context, budget).tokens == NGramMinion(max_match=4).grow(context, budget).tokens


def test_context_index_matches_brute_force():
    rng = random.Random(1)
    index = ContextIndex(max_n=3)
    tokens = [rng.randrange(4) for _ in range(60)]
    index.sync(tokens[:40])
    index.sync(tokens[:25])
    index.sync(tokens)
    for n in (1, 2, 3):
        suffix = tokens[-n:]
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1:e + 1] == suffix]
        want = [(e, tokens[e + 1:e + 4]) for e in reversed(ends)][:5]
        assert index.continuations(suffix, limit=5, length=3) == want


def test_corpus_index_finds_every_occurrence():
    rng = random.Random(2)
    corpus = [rng.randrange(5) for _ in range(500)]
    index = CorpusIndex(corpus, max_n=4)
    for pattern in ([1], [2, 3], [0, 1, 2], [4, 4, 4, 4], [9]):
        n = len(pattern)
        ends = [s + n - 1 for s in range(len(corpus) - n) if corpus[s:s + n] == pattern]
        want = [(e, corpus[e + 1:e + 3]) for e in sorted(ends, reverse=True)][:1000]
        assert index.continuations(pattern, limit=1000, length=2) == want


def test_corpus_supplies_continuations_the_conversation_lacks(tmp_path):
    corpus_file = tmp_path / "notes.txt"
    corpus_file.write_text("import numpy as np\nimport torch\n")
    encode = lambda text: list(text.encode())  # noqa: E731 - bytes as token ids
    minion = NGramMinion.from_text_file(corpus_file, encode)
    tree = minion.grow(encode("x = 1\nimport num"), GrowBudget(16, 6))
    assert bytes(best_chain(tree)) == b"py as "
    plain = NGramMinion().grow(encode("x = 1\nimport num"), GrowBudget(16, 6))
    assert bytes(best_chain(plain)) != b"py as "  # only the corpus knows what follows "num"


def test_from_spec(tmp_path):
    minion = NGramMinion.from_spec("ngram:max_match=5,min_match=2,name=lookup,recency=1.0")
    assert (minion.max_match, minion.min_match, minion.name, minion.recency) == (5, 2, "lookup", 1.0)
    assert NGramMinion.from_spec("ngram").max_match == 8
    with pytest.raises(ValueError, match="bad n-gram option"):
        NGramMinion.from_spec("ngram:depth=3")
    with pytest.raises(ModelLoadError, match="tokenizer"):
        NGramMinion.from_spec(f"ngram:corpus={tmp_path}")
    with pytest.raises(ModelLoadError, match="does not exist"):
        NGramMinion.from_spec(f"ngram:corpus={tmp_path / 'no.txt'}", encode=lambda s: [])
    (tmp_path / "c.txt").write_text("abcabc")
    with_corpus = NGramMinion.from_spec(f"ngram:corpus={tmp_path / 'c.txt'}", encode=lambda s: list(s.encode()))
    assert with_corpus.grow(list(b"zab"), GrowBudget(4, 2)).tokens[0] == ord("c")


def test_engine_greedy_identity_with_ngram(families):
    import torch
    from transformers import AutoModelForCausalLM

    from minions_local import Engine

    fam = families["llama"]
    target = AutoModelForCausalLM.from_pretrained(fam["target"]).eval()
    engine = Engine.from_pretrained(fam["target"], ["ngram", fam["other"]], dtype="float32", budget=16, max_depth=6)
    steps = []
    for prompt in ([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [20, 21, 22, 23, 20, 21]):
        out = engine.generate(prompt, max_new_tokens=40)
        ids = torch.tensor([prompt])
        reference = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                    pad_token_id=0, eos_token_id=sorted(engine.eos_ids) or None)
        assert out.token_ids == reference[0, len(prompt):].tolist()
        steps += out.steps
    # Greedy tiny random models fall into loops, which is exactly what prompt lookup catches.
    assert sum(s.minion_accepted.get("ngram", 0) for s in steps) > 0


def test_each_request_slot_keeps_its_own_index_and_shares_the_corpus():
    """Interleaved requests grow what they grow alone, and coming back to a slot finds
    its index where it was left: nothing re-indexed (a shared index would hold the
    last request's tokens). A dropped slot starts empty."""
    from tests.helpers.slots import Request, alone, interleaved

    corpus = [40, 41, 42, 43, 44] * 3
    rng = random.Random(3)
    prompts = [[rng.randrange(30) for _ in range(60)] + [40, 41] for _ in range(3)]
    budget = GrowBudget(max_nodes=12, max_depth=6, top_k=3)
    requests = {slot: Request(prompt, steps=5, budget=budget) for slot, prompt in enumerate(prompts)}
    expected = {slot: alone(lambda: NGramMinion(corpus=corpus), r) for slot, r in requests.items()}
    minion = NGramMinion(corpus=corpus)
    assert interleaved(minion, requests) == expected
    assert any(len(tree[0]) > 0 for trees in expected.values() for tree in trees)
    indexed = {}
    for slot in (2, 0, 1):
        minion.use_slot(slot)
        indexed[slot] = minion._context.tokens
        assert indexed[slot][:len(prompts[slot])] == prompts[slot]
    minion.drop_slot(2)
    minion.use_slot(2)
    assert minion._context.tokens == [] and minion.slots_held() == [0, 1, 2]
    minion.use_slot(0)
    assert minion._context.tokens == indexed[0]
