"""Fit the feature drafter to the target's features and write the shipped weights.

The drafter (minions_local/backends/eagle.py): input i is fc([embed(x[i+1]), f[i]])
where f[i] is the target's feature (final normed hidden state) at position i; one
Llama layer and a norm turn it into a guess of f[i+1], which the target's frozen
head reads. Trained as EAGLE is: regress the next feature (smooth L1) and match the
target's next-token distribution head(f[i+1]) (cross-entropy, weight CE_WEIGHT),
with the true features as inputs plus a little noise, so that the drafter's own
slightly-wrong guesses deeper in a tree look like what it trained on.

Started from a random layer, the target's final norm, and fc passing the feature
through. (Measured on 400 replies, 2 epochs, held-out greedy top-1: random layer
0.27; the target's last layer 0.17; CE weight 0.1 as in EAGLE 0.05; features alone,
no CE, 0.04: the head reads a few directions a feature regression does not weigh.)

A held-out tenth of the replies measures top-1 agreement with the target: how often
head(guess) picks the target's greedy token, given the true features so far.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minions_local.models.drafter import LAYER_PREFIX, drafter_config, trained_path, write_weights

EPOCHS = 8
BATCH_TOKENS = 4096
LR = 1e-3
CE_WEIGHT = 1.0
NOISE = 0.2
"""Uniform noise on input features, as a fraction of their RMS (EAGLE uses U(-0.5, 0.5)
on features of RMS ~1-2)."""


def load_replies(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"no replies in {path}: run `python scripts/train_drafter.py data` first")
    return rows


def batches(rows: list[int], lengths: list[int], rng: random.Random | None,
            batch_tokens: int = BATCH_TOKENS) -> list[list[int]]:
    """Row indices grouped to ~batch_tokens padded tokens, similar lengths together."""
    order = sorted(rows, key=lambda i: lengths[i])
    groups, group, width = [], [], 0
    for i in order:
        if group and max(width, lengths[i]) * (len(group) + 1) > batch_tokens:
            groups.append(group)
            group, width = [], 0
        group.append(i)
        width = max(width, lengths[i])
    if group:
        groups.append(group)
    if rng:
        rng.shuffle(groups)
    return groups


class Drafter(torch.nn.Module):
    def __init__(self, target) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        hidden = target.config.hidden_size
        self.lm = LlamaForCausalLM(drafter_config(target.config))
        self.lm.model.norm.weight.data.copy_(target.state_dict()["model.norm.weight"].float())
        # The target's, frozen (buffers: they move with the module, the optimizer never sees them).
        self.register_buffer("embed", target.get_input_embeddings().weight.detach().float(), persistent=False)
        self.register_buffer("head", target.get_output_embeddings().weight.detach().float(), persistent=False)
        self.lm.model.embed_tokens = None  # inputs come through fc
        self.lm.lm_head = None
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():
            self.fc.weight.normal_(0, 0.02 / math.sqrt(2))
            self.fc.weight[:, hidden:] += torch.eye(hidden)

    def forward(self, ids: torch.Tensor, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([F.embedding(ids, self.embed), features], dim=-1))
        return self.lm.model(inputs_embeds=x, attention_mask=mask).last_hidden_state

    def shipped(self) -> dict:
        out = {"fc.weight": self.fc.weight, "model.norm.weight": self.lm.model.norm.weight}
        out |= {LAYER_PREFIX + k: v for k, v in self.lm.model.layers[0].state_dict().items()}
        return {k: v.detach().to("cpu", torch.bfloat16) for k, v in out.items()}


def collate(rows: list[dict], features: list[torch.Tensor], group: list[int], device: str = "cpu"):
    """Inputs (tokens x[1:], features f[:-1]), padding mask, and the loss positions:
    (batch row, index i) for every i from the prompt's last token on, whose target is
    f[i + 1]."""
    seqs = [rows[i]["prompt"] + rows[i]["reply"] for i in group]
    width = max(len(s) for s in seqs) - 1
    hidden = features[group[0]].shape[1]
    ids = torch.zeros(len(group), width, dtype=torch.long)
    inputs = torch.zeros(len(group), width, hidden)
    wanted = torch.zeros(len(group), width, hidden)
    mask = torch.zeros(len(group), width, dtype=torch.long)
    where_b, where_i = [], []
    for b, (i, seq) in enumerate(zip(group, seqs)):
        n = len(seq) - 1
        ids[b, :n] = torch.tensor(seq[1:])
        inputs[b, :n] = features[i][:-1].float()
        wanted[b, :n] = features[i][1:].float()
        mask[b, :n] = 1
        first = len(rows[i]["prompt"]) - 1
        where_b += [b] * (n - first)
        where_i += list(range(first, n))
    return tuple(t.to(device) for t in (ids, inputs, mask, wanted, torch.tensor(where_b), torch.tensor(where_i)))


def step_loss(model: Drafter, batch, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    ids, inputs, mask, wanted, wb, wi = batch
    if noise:
        rms = inputs.pow(2).mean(-1, keepdim=True).sqrt()
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * 2 * noise * rms
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        guess = model(ids, inputs, mask)[wb, wi].float()
        truth = wanted[wb, wi]
        if noise and not CE_WEIGHT:  # training on the features alone: the head's matmuls are most of a step
            return F.smooth_l1_loss(guess, truth), None
        logits = F.linear(guess, model.head).float()
        with torch.no_grad():
            target_logits = F.linear(truth, model.head).float()
    p = torch.softmax(target_logits, dim=-1)
    ce = -(p * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
    loss = F.smooth_l1_loss(guess, truth) + CE_WEIGHT * ce
    agree = (logits.argmax(-1) == target_logits.argmax(-1)).float()
    return loss, agree


def evaluate(model: Drafter, rows, features, held: list[int], lengths, device: str = "cpu",
             batch_tokens: int = BATCH_TOKENS) -> dict:
    model.eval()
    result = {}
    with torch.no_grad():
        for regime in ("greedy", "sampled"):
            subset = [i for i in held if rows[i]["sampled"] == (regime == "sampled")]
            agree, n = 0.0, 0
            for group in batches(subset, lengths, None, batch_tokens):
                _, a = step_loss(model, collate(rows, features, group, device), 0.0)
                agree, n = agree + a.sum().item(), n + a.numel()
            result[f"top1_agreement_{regime}"] = round(agree / max(n, 1), 4)
    model.train()
    return result


def train_and_release(replies: Path, features_path: Path, *, seed: int = 0, epochs: int = EPOCHS,
                      out: Path | None = None, limit: int | None = None, device: str = "cpu",
                      batch_tokens: int = BATCH_TOKENS) -> dict:
    from drafter.features import target_features
    from drafter.replies import load_target
    from minions_local.models.checksum import sha256_of
    from minions_local.models.smollm2 import ensure_folder

    torch.manual_seed(seed)
    rng = random.Random(seed)
    rows = load_replies(replies)[:limit]
    target, _ = load_target(device)
    features = target_features(target, rows, features_path, batch_tokens=2 * batch_tokens)
    model = Drafter(target).to(device)
    target_sha = sha256_of(ensure_folder() / "model.safetensors")
    del target
    lengths = [len(r["prompt"]) + len(r["reply"]) for r in rows]
    order = list(range(len(rows)))
    rng.shuffle(order)
    held, train = order[:max(1, len(rows) // 10)], order[max(1, len(rows) // 10):]
    before = evaluate(model, rows, features, held, lengths, device, batch_tokens)
    tokens = sum(len(rows[i]["reply"]) for i in train)
    print(f"{len(train)} training replies ({tokens} tokens), {len(held)} held out; before training: {before}",
          flush=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    steps = epochs * len(batches(train, lengths, None, batch_tokens))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 30) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))
    start = time.perf_counter()
    for epoch in range(epochs):
        total, count = 0.0, 0
        for group in batches(train, lengths, rng, batch_tokens):
            loss, _ = step_loss(model, collate(rows, features, group, device), NOISE)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            total, count = total + loss.item(), count + 1
        after = evaluate(model, rows, features, held, lengths, device, batch_tokens)
        print(f"epoch {epoch + 1}/{epochs}: loss {total / count:.4f}, {after}, {time.perf_counter() - start:.0f} s",
              flush=True)
        # Written every epoch: a run stopped early (a GPU call's time limit) leaves a drafter.
        info = {"trained_on": f"{len(train)} target replies, {tokens} tokens", "held_out": after,
                "before_training": before, "epochs": epoch + 1, "seed": seed, "target_sha256": target_sha}
        path = write_weights(model.shipped(), info, out or trained_path())
    return {"written": str(path), **after, "before": before, "seconds": round(time.perf_counter() - start)}
