"""Sampled drafts through the multi-draft rejection rule stay exact (chi-square).

The fixed-tree test draws fresh proposals every trial from known distributions,
merges them like the decoder does and checks the law of the first two committed
tokens against the target's own. It must also be able to fail: the same test with
a deliberately wrong rule has to be rejected.
"""

from collections import Counter

import pytest
import torch

from minions_local import Engine
from minions_local.core.protocols import CandidateTree
from minions_local.backends.frontier import draw_without_replacement
from minions_local.speculation import accept as accept_module
from minions_local.core.sampling import SamplingParams, processed_probs
from minions_local.speculation.accept import accept
from minions_local.speculation.vote import merge_sampled, source_shares
from tests.helpers.stats import chi2_pvalue, first_two_tokens
from tests.helpers.tiny_models import noisy_copy, random_model, save, tiny_config

VOCAB = 6
PARAMS = SamplingParams(temperature=0.9, top_k=5)


def law_setup():
    """Target logits at the root and after each first token, and the minions' q's."""
    gen = torch.Generator().manual_seed(7)
    root = torch.randn(VOCAB, generator=gen) * 1.5
    after = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
    # After token 1 the target allows only 2 and 3: the deterministic entries 2, 3
    # there leave a zero residual once 2 is rejected.
    after[1] = -1e4
    after[1, 2], after[1, 3] = 0.5, 0.0
    q_a_root = torch.softmax(torch.tensor([3.5, 0.0, 0.5, -0.5, 0.0, 0.0]), -1)  # one peak: SWOR matters
    q_b_root = torch.softmax(torch.randn(VOCAB, generator=gen), -1)
    q_a_after = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 2, -1)
    # After token 0 minion A is exactly the target: its first draw is always accepted.
    q_a_after[0] = processed_probs(after[0], PARAMS)
    return root, after, q_a_root, q_b_root, q_a_after


def sampled_proposals(gen, q_a_root, q_b_root, q_a_after):
    """A: 2 draws at the root, 2 below each; B: 1 draw at the root (often A's token);
    C: deterministic 5 -> 2 and 1 -> {2, 3}."""
    a = CandidateTree()
    a.draws[-1] = q_a_root
    for token in draw_without_replacement(q_a_root, 2, gen):
        node = a.add(token, -1, 0.0)
        a.draws[node] = q_a_after[token]
        for child in draw_without_replacement(q_a_after[token], 2, gen):
            a.add(child, node, 0.0)
    b = CandidateTree()
    b.draws[-1] = q_b_root
    b.add(draw_without_replacement(q_b_root, 1, gen)[0], -1, 0.0)
    c = CandidateTree()
    five, one = c.add(5, -1, 0.0), c.add(1, -1, 0.0)
    c.add(2, five, 0.0)
    c.add(2, one, 0.0)
    c.add(3, one, 0.0)
    return [a, b, c]


def first_two_law(n: int, seed: int) -> float:
    root, after, *qs = law_setup()
    p_root = processed_probs(root, PARAMS)
    p_after = processed_probs(after, PARAMS)
    expected = {}
    for x1 in range(VOCAB):
        for x2 in range(VOCAB):
            if float(p_root[x1] * p_after[x1, x2]) > 0:
                expected[(x1, x2)] = float(p_root[x1] * p_after[x1, x2])
    gen = torch.Generator().manual_seed(seed)
    seen = Counter()
    for _ in range(n):
        tree = merge_sampled(0, sampled_proposals(gen, *qs), [1.0, 1.0, 1.0], None, [0, 1, 2])
        logits = torch.zeros(len(tree), VOCAB)
        for node in range(1, len(tree)):
            if tree.depths[node] == 1:
                logits[node] = after[tree.tokens[node]]
        logits[0] = root
        path, bonus = accept(tree, logits, PARAMS, gen)
        if len(path) > 1:
            x2 = tree.tokens[path[2]] if len(path) > 2 else bonus
        else:
            # Rejected at the root: the second token comes from the target's next row.
            x2 = int(torch.multinomial(p_after[bonus], 1, generator=gen))
        seen[((tree.tokens[path[1]] if len(path) > 1 else bonus), x2)] += 1
    return chi2_pvalue(seen, expected, n)


def test_sampled_entries_follow_the_target():
    assert first_two_law(12000, seed=11) > 0.001


@pytest.mark.parametrize("wrong", ["no_replacement_correction", "no_residual"])
def test_chi_square_rejects_a_wrong_rule(monkeypatch, wrong):
    if wrong == "no_replacement_correction":
        # Treat every draw as if it followed the minion's full q.
        real = accept_module.draft_distribution
        monkeypatch.setattr(accept_module, "draft_distribution", lambda q, drawn, vocab: real(q, [], vocab))
    else:
        # Keep accepting with min(1, p/q) but never move to the residual.
        monkeypatch.setattr(accept_module, "_rejection_residual", lambda p, q, token: p.clone())
    assert first_two_law(12000, seed=11) < 0.001


def test_merge_orders_sampled_entries_first():
    q_a_root, q_b_root, q_a_after = law_setup()[2:]
    tree = merge_sampled(0, sampled_proposals(torch.Generator().manual_seed(3), q_a_root, q_b_root, q_a_after),
                         [1.0, 1.0, 1.0], None, [0, 1, 2])
    root_entries = tree.entries[0]
    (_, a1), (_, a2), (_, b1) = root_entries[:3]
    # A's two draws share one stored q, then B's draw with its own.
    assert a1 == a2 != b1 and tree.drafts[a1] is q_a_root and tree.drafts[b1] is q_b_root
    assert [(t, d) for t, d in root_entries[3:]] == [(5, -1), (1, -1)]
    assert all(tree.children[0][t] for t, _ in root_entries)


def test_sampled_merge_refuses_a_draw_past_the_vocabulary():
    """Dropping a drawn token for its value would bias the draws after it: a sampling
    minion must draw below the limit it was given, and the merge says so when it did not."""
    q = torch.full((8,), 1 / 8)
    drawn = CandidateTree()
    drawn.draws[-1] = q
    drawn.add(7, -1, 0.0)
    with pytest.raises(ValueError, match="vocabulary"):
        merge_sampled(0, [drawn], [1.0], 6, [0])
    assert merge_sampled(0, [drawn], [1.0], 8, [0]).entries[0] == [(7, 0)]
    fixed = CandidateTree()
    fixed.add(7, -1, 0.0)
    assert merge_sampled(0, [fixed], [1.0], 6, [0]).tokens == [0]  # a deterministic pick just goes


def test_source_shares_depend_on_weights_only():
    shares = source_shares([1.0, 0.3, 0.05], [True, True, True], 16, 6, 8)
    assert sum(shares) == 16 and shares[0] > shares[1] >= shares[2] >= 1
    assert source_shares([1.0, 1.0], [True, False], 8, 4, 8) == [8, 0]
    assert sum(source_shares([1.0] * 4, [True] * 4, 2, 4, 8)) == 2


@pytest.fixture(scope="module")
def two_minion_family(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampledfamily")
    config = tiny_config("llama", vocab=12, hidden=32, layers=2)
    target = random_model(config, 5, scale=6.0)
    close = noisy_copy(target, 6, noise=0.05)
    rough = noisy_copy(target, 7, noise=0.5)
    return save(target, root / "t"), save(close, root / "c"), save(rough, root / "r"), target


def test_engine_sampled_drafts_law_of_first_tokens(two_minion_family, monkeypatch):
    """Two real HF minions drawing their trees (duplicates across them are common
    with 12 tokens) plus the n-gram minion: the first two tokens follow the target."""
    import minions_local.engine.reply as engine_module

    # Unseeded requests draw their drafts; their randomness comes from here (made
    # repeatable for the test without turning them into seeded requests).
    stream = iter(range(10**6))
    monkeypatch.setattr(engine_module.random, "getrandbits", lambda bits: next(stream))
    target_dir, close_dir, rough_dir, target = two_minion_family
    engine = Engine.from_pretrained(target_dir, [close_dir, rough_dir, "ngram"], budget=10, max_depth=3,
                                    selection="all")
    prompt = [3, 7, 1, 3, 7]
    sp = SamplingParams(0.8, 1.0, 6)
    with torch.no_grad():
        p1 = processed_probs(target(torch.tensor([prompt])).logits[0, -1], sp)
        ctx = torch.tensor([prompt + [x] for x in range(12)])
        p2 = processed_probs(target(ctx).logits[:, -1], sp)
    expected = {(x1, x2): float(p1[x1] * p2[x1, x2]) for x1 in range(12) for x2 in range(12)
                if float(p1[x1] * p2[x1, x2]) > 0}
    n = 1500
    seen, multi = first_two_tokens(engine, prompt, n, temperature=0.8, top_k=6)
    assert multi > n // 3, "sampled drafts should often serve both tokens in one pass"
    assert chi2_pvalue(seen, expected, n) > 0.001


def test_sampled_step_records_draft_entries(two_minion_family):
    target_dir, close_dir, rough_dir, _ = two_minion_family
    engine = Engine.from_pretrained(target_dir, [close_dir, rough_dir], budget=8, max_depth=3)
    ids = [3, 7, 1]
    engine.generate(ids, max_new_tokens=1)  # every model's cache holds the prompt
    result = engine.decoder.step(ids, SamplingParams(1.0), torch.Generator().manual_seed(0), 4)
    tree = result.tree
    assert tree.drafts and tree.draft_size <= 8
    assert all(tree.entries[n] for n in range(len(tree)) if tree.children[n])
    greedy = engine.decoder.step(ids, SamplingParams(0.0), None, 4).tree
    assert not greedy.drafts
