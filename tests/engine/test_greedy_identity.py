"""Greedy speculative output is token-identical to the target's own greedy decoding."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from minions_local import Engine
from tests.helpers.tiny_models import hf_greedy, make_family


def random_prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_matches_target_alone(families, arch):
    fam = families[arch]
    target = AutoModelForCausalLM.from_pretrained(fam["target"]).eval()
    engine = Engine.from_pretrained(fam["target"], [fam["close"], fam["shallow"], fam["other"]],
                                    dtype="float32", budget=24, max_depth=8)
    accepted = []
    for prompt in random_prompts(8, 96, seed=hash(arch) % 1000):
        out = engine.generate(prompt, max_new_tokens=40)
        assert out.token_ids == hf_greedy(target, prompt, 40)
        accepted += [s.accepted for s in out.steps]
    # The close minions must really be exercised: deep acceptance, and some rejections.
    assert max(accepted) >= 4
    assert sum(accepted) / len(accepted) > 1.5
    assert min(accepted) < max(accepted)


@pytest.mark.parametrize("budget,depth", [(1, 1), (6, 6), (64, 12), ("adaptive", 8)])
def test_greedy_identity_across_budgets(families, budget, depth):
    fam = families["llama"]
    target = AutoModelForCausalLM.from_pretrained(fam["target"]).eval()
    engine = Engine.from_pretrained(fam["target"], [fam["close"], fam["other"]], budget=budget, max_depth=depth)
    for prompt in random_prompts(4, 96, seed=7):
        assert engine.generate(prompt, max_new_tokens=33).token_ids == hf_greedy(target, prompt, 33)


def test_no_minions_is_autoregressive(families):
    fam = families["qwen2"]
    target = AutoModelForCausalLM.from_pretrained(fam["target"]).eval()
    engine = Engine.from_pretrained(fam["target"], [])
    prompt = [5, 9, 17, 4]
    out = engine.generate(prompt, max_new_tokens=12)
    assert out.token_ids == hf_greedy(target, prompt, 12)
    assert len(out.steps) == 12 and all(s.tree_size == 0 and s.accepted == 0 for s in out.steps)


def test_heterogeneous_minion_architectures(tmp_path, tokenizer):
    fam = make_family(tmp_path, "llama", minion_arch="qwen2", tokenizer=tokenizer, seed=3)
    mistral = make_family(tmp_path / "m", "mistral", tokenizer=tokenizer, seed=3)["other"]
    target = AutoModelForCausalLM.from_pretrained(fam["target"]).eval()
    engine = Engine.from_pretrained(fam["target"], [fam["other"], mistral, fam["close"]], budget=16)
    for prompt in random_prompts(4, 96, seed=11):
        assert engine.generate(prompt, max_new_tokens=30).token_ids == hf_greedy(target, prompt, 30)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bfloat16_greedy_is_identical_to_bfloat16_autoregressive(families, arch):
    """In bf16 the target's tree rows are row-invariant (float64 attention), so the
    speculative reply is the autoregressive one token for token, near-ties included.
    Random tiny models are full of near-ties: without row invariance this fails."""
    fam = families[arch]
    alone = Engine.from_pretrained(fam["target"], [], dtype="bfloat16")
    engine = Engine.from_pretrained(fam["target"], [fam["close"], "ngram"], dtype="bfloat16", budget=24,
                                    max_depth=8)
    target = AutoModelForCausalLM.from_pretrained(fam["target"], dtype=torch.bfloat16).eval()
    accepted = []
    for prompt in random_prompts(6, 96, seed=21):
        ours = engine.generate(prompt, max_new_tokens=40)
        assert ours.token_ids == alone.generate(prompt, max_new_tokens=40).token_ids
        accepted += [s.accepted for s in ours.steps]
        # transformers' own bf16 passes round otherwise: the same reply up to a near-tie.
        assert ours.token_ids[:4] == hf_greedy(target, prompt, 4)
    assert max(accepted) >= 3


def test_bfloat16_conversation_matches_the_target_reading_it_from_scratch(families):
    """The reference for every turn is the target alone reading the whole conversation
    from an empty cache. Replies are decoded on row-invariant passes whose entries are
    not a prompt's, so after a reply the cache holds only its prompt's entries (a reply
    whose stop token a step accepted mid-tree included), and the next turn re-reads the
    reply as prompt. Turn after turn, replies stay identical."""
    fam = families["llama"]
    alone = Engine.from_pretrained(fam["target"], [], dtype="bfloat16")
    engine = Engine.from_pretrained(fam["target"], [fam["close"], "ngram"], dtype="bfloat16", budget=24,
                                    max_depth=8)
    prompt = random_prompts(1, 96, seed=5)[0]
    alone.eos_ids = set()
    first = alone.generate(prompt, max_new_tokens=40).token_ids
    alone.eos_ids = engine.eos_ids = {first[20]}  # a token the reply reaches well into it
    cut_mid_step = 0
    for turn in range(4):
        alone.reset()
        ours, theirs = engine.generate(prompt, max_new_tokens=40), alone.generate(prompt, max_new_tokens=40)
        assert ours.token_ids == theirs.token_ids
        assert engine.decoder.target.cached == alone.decoder.target.cached == prompt[:-1]
        last = ours.steps[-1]
        cut_mid_step += ours.finish_reason == "stop" and last.accepted + 1 > last.new_tokens
        prompt = prompt + ours.token_ids + [7 + turn, 30, 41]
    assert cut_mid_step, "no step accepted tokens past the stop: the case this test is for never ran"


def test_a_long_prompt_gets_its_first_token_from_the_target_alone(families, monkeypatch):
    """With no core to spare, the minions read a long prompt only after the target gave
    the first token (one step without a tree); replies stay the target's own, and a
    short follow-up is read with its prompt as before."""
    from minions_local.speculation import decode

    monkeypatch.setattr(decode, "_spare_core", lambda target: False)
    monkeypatch.setattr(decode.Decoder, "MINIONS_READ_LATER", 40)
    fam = families["llama"]
    target = AutoModelForCausalLM.from_pretrained(fam["target"]).eval()
    engine = Engine.from_pretrained(fam["target"], [fam["close"], "ngram"], budget=16, max_depth=6)
    read = []
    close = engine.decoder.minions[0]
    original = close.prefill
    monkeypatch.setattr(close, "prefill", lambda context: read.append(len(context)) or original(context))
    together = close.prefill_batch  # (reads the target is not running beside)
    monkeypatch.setattr(close, "prefill_batch", lambda requests: read.extend(len(c) for _, c in requests)
                        or together(requests))
    prompt = random_prompts(4, 96, seed=3)
    prompt = [t for p in prompt for t in p] * 3
    assert len(prompt) >= 40
    first = engine.generate(prompt, max_new_tokens=20)
    assert first.token_ids == hf_greedy(target, prompt, 20)
    assert first.steps[0].tree_size == 0 and first.steps[0].new_tokens == 1
    assert max(s.tree_size for s in first.steps[1:]) > 0
    assert read == [len(prompt) + 1]  # read once, before the second step
    follow_up = prompt + first.token_ids + [5, 6, 7]
    second = engine.generate(follow_up, max_new_tokens=12)
    assert second.token_ids == hf_greedy(target, follow_up, 12)
    assert second.steps[0].tree_size > 0 and read[-1] == len(follow_up)
