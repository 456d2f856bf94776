"""The shipped demo family, made from the Python standard library (scripts/train_demo_family.py).

`spec` (shapes, budgets, size rules), `corpus` (stdlib text; third-party code held
out), `tokenizer` (byte-level BPE and the chat format), `training` (target, then
minions distilled from it), `evaluation` (losses, greedy agreement, simulated tokens
per pass) and `release` (bf16 HF folders, manifest, model card).
"""
