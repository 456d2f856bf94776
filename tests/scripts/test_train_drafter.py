"""scripts/train_drafter.py's parts on a tiny random target: prompts that never leak
the benchmark's, inputs aligned as the feature drafter reads them at decode time,
a loss that falls, and weights the minion loader accepts."""

from __future__ import annotations

import random

import pytest
import torch

from drafter import training
from drafter.prompts import training_prompts
from minions_local.models import drafter
from tests.helpers.tiny_models import random_model, tiny_config


def test_training_prompts_are_distinct_and_never_the_benchmarks():
    from benchmarks.chat_prompts import CHAT_PROMPTS

    bench = tuple(text for _, text in CHAT_PROMPTS)
    prompts = training_prompts(1000, exclude=bench)
    assert len(set(prompts)) == 1000 and not set(prompts) & set(bench)
    assert training_prompts(5, seed=1) == training_prompts(5, seed=1) != training_prompts(5, seed=2)
    with pytest.raises(ValueError, match="distinct training prompts"):
        training_prompts(10 ** 6)


def synthetic(target, n: int, seed: int = 0):
    """Rows of the target's own greedy continuations and their features."""
    g = torch.Generator().manual_seed(seed)
    rows, features = [], []
    for i in range(n):
        prompt = torch.randint(3, 96, (5,), generator=g).tolist()
        with torch.no_grad():
            seq = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0]
            hidden = target(seq[None], output_hidden_states=True).hidden_states[-1][0]
        rows.append({"prompt": prompt, "reply": seq[5:].tolist(), "sampled": i % 2 == 1})
        features.append(hidden)
    return rows, features


def test_inputs_pair_each_token_with_the_feature_before_it():
    target = random_model(tiny_config("llama", layers=2), seed=2, scale=25.0)
    rows, features = synthetic(target, 2)
    ids, inputs, mask, wanted, wb, wi = training.collate(rows, features, [0, 1])
    seq = rows[0]["prompt"] + rows[0]["reply"]
    assert ids[0, :len(seq) - 1].tolist() == seq[1:]
    assert torch.equal(inputs[0, 3], features[0][3]) and torch.equal(wanted[0, 3], features[0][4])
    # Loss from the prompt's last position on: there the guess is the first reply token's feature.
    assert wi[wb == 0].tolist() == list(range(4, len(seq) - 1))
    assert mask.sum().item() == sum(len(r["prompt"]) + len(r["reply"]) - 1 for r in rows)


def test_training_lowers_the_loss_and_writes_weights_the_loader_takes(tmp_path):
    target = random_model(tiny_config("llama", layers=2), seed=3, scale=25.0)
    rows, features = synthetic(target, 12)
    model = training.Drafter(target)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    lengths = [len(r["prompt"]) + len(r["reply"]) for r in rows]
    losses = []
    for _ in range(30):
        for group in training.batches(list(range(12)), lengths, random.Random(0)):
            loss, _ = training.step_loss(model, training.collate(rows, features, group), 0.0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    path = drafter.write_weights(model.shipped(), {"test": True}, tmp_path / "d.safetensors")
    built, fc = drafter.build_drafter(target, path)
    assert fc.shape == (64, 128) and built.model.embed_tokens.weight is target.model.embed_tokens.weight
