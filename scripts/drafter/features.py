"""The target's top-layer features over the training replies (teacher forcing).

A feature is the target's final normed hidden state at a position: what its head
turns into the next token's distribution. The drafter learns to predict the next
position's feature from this one and the next token (models/eagle.py), so training
needs the target's feature at every position of every prompt + reply. One batched
bf16 pass per group of rows; stored as one bf16 tensor per row (~210 MB for 1000
replies).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


@torch.inference_mode()
def target_features(model, rows: list[dict], out: Path, *, batch_tokens: int = 8192,
                    log=print) -> list[torch.Tensor]:
    """[len(prompt) + len(reply), hidden] bf16 per row, saved to `out` (and reused)."""
    if out.exists():
        saved = torch.load(out)
        if len(saved) == len(rows) and all(f.shape[0] == len(r["prompt"]) + len(r["reply"])
                                           for f, r in zip(saved, rows)):
            return saved
    from drafter.training import batches

    features: list[torch.Tensor | None] = [None] * len(rows)
    device = next(model.parameters()).device
    lengths = [len(r["prompt"]) + len(r["reply"]) for r in rows]
    start, done = time.perf_counter(), 0

    def run(group: list[int]) -> None:
        seqs = [rows[i]["prompt"] + rows[i]["reply"] for i in group]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        for b, s in enumerate(seqs):
            ids[b, :len(s)] = torch.tensor(s)
            mask[b, :len(s)] = 1
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # normed
        for b, i in enumerate(group):
            features[i] = hidden[b, :len(seqs[b])].to("cpu", torch.bfloat16).clone()

    for group in batches(list(range(len(rows))), lengths, None, batch_tokens):  # similar lengths together
        run(group)
        done += len(group)
        log(f"  features {done}/{len(rows)} rows, {time.perf_counter() - start:.0f} s")
    torch.save(features, out)
    return features
