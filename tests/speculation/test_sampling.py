"""Sampling through the tree follows the target's distribution exactly (chi-square)."""

import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.stats import chi2_pvalue
from minions_local import Engine
from minions_local.core.sampling import SamplingParams, processed_probs
from minions_local.speculation.accept import accept
from minions_local.core.tree import TokenTree
from tests.helpers.tiny_models import make_family, noisy_copy, random_model, save, tiny_config


def test_processed_probs_top_k_top_p():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert p[3] == 0 and p[4] == 0 and math.isclose(float(p.sum()), 1.0, rel_tol=1e-6)
    full = torch.softmax(logits, -1)
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    # Smallest set whose mass reaches 0.7: the top two (0.64 + 0.24).
    assert (p > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(p[:2], full[:2] / full[:2].sum())
    p = processed_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1))


def test_tree_walk_matches_sequential_sampling():
    """accept() on a fixed tree and fixed distributions: law of the first two tokens."""
    torch.manual_seed(0)
    vocab = 6
    tree = TokenTree.from_root(0)
    a = tree.add(0, 1)
    b = tree.add(0, 2)
    tree.add(a, 3)
    tree.add(a, 4)
    logits = torch.randn(len(tree), vocab) * 1.5
    params = SamplingParams(temperature=0.9, top_k=5)
    probs = processed_probs(logits, params)
    expected = {}
    for x1 in range(vocab):
        node = tree.child(0, x1)
        if node is None:
            expected[(x1,)] = float(probs[0, x1])
        else:
            for x2 in range(vocab):
                expected[(x1, x2)] = float(probs[0, x1] * probs[node, x2])
    gen = torch.Generator().manual_seed(1234)
    n = 20000
    seen = Counter()
    for _ in range(n):
        path, bonus = accept(tree, logits, params, gen)
        seq = tuple(tree.tokens[i] for i in path[1:]) + (bonus,)
        seen[seq[:2]] += 1
    assert chi2_pvalue(seen, expected, n) > 0.001


@pytest.fixture(scope="module")
def small_vocab_family(tmp_path_factory):
    root = tmp_path_factory.mktemp("smallvocab")
    config = tiny_config("llama", vocab=12, hidden=32, layers=2)
    target = random_model(config, 5, scale=6.0)  # spread-out distributions
    close = noisy_copy(target, 6, noise=0.05)
    return save(target, root / "t"), save(close, root / "c"), target


def test_engine_sampling_law_of_first_tokens(small_vocab_family):
    target_dir, close_dir, target = small_vocab_family
    engine = Engine.from_pretrained(target_dir, [close_dir], budget=8, max_depth=3)
    prompt = [3, 7, 1]
    params = dict(temperature=0.8, top_p=0.95)
    sp = SamplingParams(0.8, 0.95, 0)
    with torch.no_grad():
        p1 = processed_probs(target(torch.tensor([prompt])).logits[0, -1], sp)
        ctx = torch.tensor([prompt + [x] for x in range(12)])
        p2 = processed_probs(target(ctx).logits[:, -1], sp)
    expected = {(x1, x2): float(p1[x1] * p2[x1, x2]) for x1 in range(12) for x2 in range(12)}
    n = 1500
    seen = Counter()
    multi = 0
    for seed in range(n):
        out = engine.generate(prompt, max_new_tokens=2, seed=seed, **params)
        seen[tuple(out.token_ids)] += 1
        multi += out.steps[0].accepted > 0
    assert multi > n // 4, "the tree should often serve both tokens in one pass"
    assert chi2_pvalue(seen, expected, n) > 0.001


def test_seeded_sampling_is_reproducible(families):
    """A seed repeats the output whatever the engine has learned in between (vote
    weights, adaptive budgets and timings all move the tree): seeded requests keep
    fixed drafts, so each committed token is one seeded draw from the target."""
    fam = families["llama"]
    engine = Engine.from_pretrained(fam["target"], [fam["close"], fam["other"]])
    first = engine.generate([4, 8, 15], max_new_tokens=25, temperature=1.0, seed=1).token_ids
    for s in range(3):  # the selector and the budget policy learn from these
        engine.generate([9, 9, 2, 5], max_new_tokens=20, temperature=1.0)
    again = engine.generate([4, 8, 15], max_new_tokens=25, temperature=1.0, seed=1).token_ids
    other = engine.generate([4, 8, 15], max_new_tokens=25, temperature=1.0, seed=2).token_ids
    fresh = Engine.from_pretrained(fam["target"], [fam["other"]], budget=4)  # another tree altogether
    assert first == again == fresh.generate([4, 8, 15], max_new_tokens=25, temperature=1.0, seed=1).token_ids
    assert first != other
