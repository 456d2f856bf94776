"""Training the demo family: the target on the corpus, the minions distilled from it.

All randomness flows from one ``torch.Generator`` per purpose, seeded from ``--seed``;
budgets are step counts. bf16 autocast on CPU (AMX makes bf16 matmuls several times
faster than fp32 there, see PLATFORM_FACTS.md); master weights stay fp32.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from demo_family import corpus
from demo_family.spec import Budget
from demo_family.tokenizer import END_OF_TEXT, render_chat


def training_text(doc: corpus.Document) -> str:
    """A document as the models see it; chat-form documents end with their own EOS."""
    if corpus.wants_chat_form(doc):
        user, reply = corpus.chat_request_for(doc)
        return render_chat([{"role": "user", "content": user}, {"role": "assistant", "content": reply}]).rstrip("\n")
    return doc.text + END_OF_TEXT


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """EOS, then the texts back to back: every document starts right after an EOS,
    as a chat prompt starts right after the template's BOS."""
    ids = [tokenizer.eos_token_id]
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
    return torch.tensor(ids, dtype=torch.long)


class WindowStream:
    """Non-overlapping (seq_len + 1)-token windows of one token stream, shuffled per epoch."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int):
        n_windows = (tokens.numel() - 1) // seq_len
        if n_windows < 1:
            raise ValueError(f"corpus of {tokens.numel()} tokens is shorter than one window of {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.n_windows = n_windows
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.empty(0, dtype=torch.long)
        self.cursor = 0
        self.epochs = 0

    def next_batch(self, batch_size: int) -> torch.Tensor:
        rows = []
        for _ in range(batch_size):
            if self.cursor >= self.order.numel():
                self.order = torch.randperm(self.n_windows, generator=self.generator)
                self.cursor = 0
                self.epochs += 1
            start = int(self.order[self.cursor]) * self.seq_len
            self.cursor += 1
            rows.append(self.tokens[start : start + self.seq_len + 1])
        return torch.stack(rows)


def make_optimizer(model: PreTrainedModel, lr: float) -> torch.optim.AdamW:
    # No weight decay on norms and biases: decaying them only hurts small models.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine down to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclass
class Learner:
    """A model with its optimizer and its own step count / schedule."""

    model: PreTrainedModel
    optimizer: torch.optim.AdamW
    total_steps: int
    peak_lr: float
    warmup: int
    step: int = 0
    last_loss: float = float("nan")

    def apply(self, loss: torch.Tensor) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.total_steps, self.peak_lr, self.warmup)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.last_loss = float(loss.detach())


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def distill_loss(student_logits: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
    """Forward KL(teacher || student) per token: pulls the student's mode onto the
    teacher's, which is what greedy agreement rewards."""
    student_log_probs = F.log_softmax(student_logits.float(), dim=-1)
    kl = (teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)).sum(-1)
    return kl.mean()


def train_family(
    target: PreTrainedModel,
    minions: dict[str, PreTrainedModel],
    stream: WindowStream,
    budget: Budget,
    log: Callable[[str], None] = print,
    log_every: int = 25,
) -> dict[str, float]:
    """Run the three phases of ``Budget``; returns final training losses by model name."""
    target_learner = Learner(
        target, make_optimizer(target, budget.target_lr), budget.target_steps, budget.target_lr, budget.warmup_steps
    )
    minion_learners = {
        name: Learner(m, make_optimizer(m, budget.minion_lr), budget.minion_steps, budget.minion_lr, budget.warmup_steps)
        for name, m in minions.items()
    }
    started = time.monotonic()
    for step in range(budget.total_steps):
        batch = stream.next_batch(budget.batch_size)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        teacher_log_probs = _target_step(target_learner, inputs, labels, train=step < budget.target_steps)
        if step >= budget.target_alone_steps:
            for learner in minion_learners.values():
                _minion_step(learner, inputs, teacher_log_probs)
        if step % log_every == 0 or step == budget.total_steps - 1:
            _log_progress(log, step, budget, started, target_learner, minion_learners, stream)
    losses = {"target": target_learner.last_loss}
    losses.update({name: learner.last_loss for name, learner in minion_learners.items()})
    return losses


def _target_step(learner: Learner, inputs: torch.Tensor, labels: torch.Tensor, train: bool) -> torch.Tensor:
    """One target step (or a frozen forward); returns its detached log-probs as the
    minions' teacher signal."""
    model = learner.model
    model.train(train)
    with torch.set_grad_enabled(train), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=inputs).logits
    if train:
        learner.apply(next_token_loss(logits, labels))
    return F.log_softmax(logits.detach().float(), dim=-1)


def _minion_step(learner: Learner, inputs: torch.Tensor, teacher_log_probs: torch.Tensor) -> None:
    learner.model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = learner.model(input_ids=inputs).logits
    learner.apply(distill_loss(logits, teacher_log_probs))


def _log_progress(log, step, budget, started, target_learner, minion_learners, stream) -> None:
    elapsed = time.monotonic() - started
    tokens = (step + 1) * budget.batch_size * budget.seq_len
    parts = [f"step {step + 1}/{budget.total_steps}", f"target ce {target_learner.last_loss:.3f}"]
    parts += [f"{name} kl {learner.last_loss:.3f}" for name, learner in minion_learners.items() if learner.step]
    parts += [f"epoch {stream.epochs}", f"{tokens / max(elapsed, 1e-9):.0f} tok/s", f"{elapsed / 60:.1f} min"]
    log(" | ".join(parts))


def iterate_windows(tokens: torch.Tensor, window: int, max_windows: int) -> Iterator[torch.Tensor]:
    """Consecutive windows from the start of a token stream (evaluation, no randomness)."""
    for i in range(min(max_windows, tokens.numel() // window)):
        yield tokens[i * window : (i + 1) * window]
