"""Stand-in models for the benchmark while the trained demo family is not there.

Random weights in the demo family's exact shapes (scripts/demo_family/spec.py), on a
byte-level BPE tokenizer trained in seconds on a few stdlib files, saved as bf16 HF
folders like the shipped family. Their speeds are real (same shapes, same code
paths); their acceptance rates are not (random minions rarely agree with a random
target), so figures measured on them say nothing about speculation.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from demo_family.spec import FULL, QUICK, FamilySpec
from demo_family.tokenizer import as_hf_tokenizer, train_byte_level_bpe

# A fixed handful of stdlib modules: enough text for a 4096-token BPE, quick to train.
TOKENIZER_SOURCES = ("collections/__init__.py", "functools.py", "inspect.py", "argparse.py", "typing.py")


def _tokenizer(vocab_size: int, sources: tuple[str, ...]):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / rel).read_text(encoding="utf-8") for rel in sources if (stdlib / rel).is_file()]
    return as_hf_tokenizer(train_byte_level_bpe(texts, vocab_size), model_max_length=2048)


def build_standins(root: Path, *, tiny: bool = False, seed: int = 0) -> dict[str, Path]:
    """Write target + minions under `root`; returns {'target': path, minion name: path}."""
    spec: FamilySpec = QUICK if tiny else FULL
    tokenizer = _tokenizer(spec.vocab_size, TOKENIZER_SOURCES[1:2] if tiny else TOKENIZER_SOURCES)
    # The tokenizer may come out a little smaller than asked; the models keep the spec's
    # vocabulary (ids past the tokenizer's are simply never produced by it).
    bos = eos = tokenizer.eos_token_id
    paths: dict[str, Path] = {}
    for i, shape in enumerate((spec.target, *spec.minions)):
        torch.manual_seed(seed + i)
        model = shape.build(spec.vocab_size, bos, eos).to(torch.bfloat16).eval()
        folder = root / shape.name
        model.save_pretrained(str(folder), safe_serialization=True)
        tokenizer.save_pretrained(str(folder))
        paths[shape.name] = folder
    return paths
