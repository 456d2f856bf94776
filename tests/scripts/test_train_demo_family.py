"""The demo-family training script: corpus rules, tokenizer/chat template, the
speculative-decoding simulation it reports, and a --quick end-to-end run."""

from __future__ import annotations

import json

import pytest
import torch
from demo_family import corpus as demo_corpus
from demo_family import evaluation as demo_eval
from demo_family.tokenizer import END_OF_TEXT, as_hf_tokenizer, render_chat, train_byte_level_bpe


def test_corpus_never_reads_site_packages_or_tests():
    corpus = demo_corpus.build_stdlib_corpus(max_files=80)
    sources = [d.source for d in corpus.train + corpus.held_out]
    assert sources
    for source in sources:
        parts = source.split("#")[0].split("/")
        assert not set(parts) & demo_corpus.EXCLUDED_DIRS, source


def test_held_out_split_is_fixed_and_disjoint():
    docs = [demo_corpus.Document(f"pkg/mod{i}.py", "x = 1\n") for i in range(400)]
    train, held = demo_corpus.split_held_out(docs)
    assert held and not {d.source for d in train} & {d.source for d in held}
    assert demo_corpus.split_held_out(docs) == (train, held)


def test_chat_template_matches_the_corpus_rendering():
    tokenizer = as_hf_tokenizer(train_byte_level_bpe(["def f(x):\n    return x\n"] * 20, 300), 256)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": "A sequence."},
        {"role": "user", "content": "And a dict?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == END_OF_TEXT + render_chat(messages, add_generation_prompt=True)
    assert rendered.endswith("### Assistant:\n")


def test_byte_level_bpe_round_trips_any_text():
    tokenizer = as_hf_tokenizer(train_byte_level_bpe(["import os\nprint('hi')\n"] * 20, 300), 256)
    text = "déjà vu → 🐍\n\tif x:\n        pass"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokens_per_pass_simulation():
    agree_all = torch.ones(18, dtype=torch.bool)
    assert demo_eval.tokens_per_pass([agree_all], depth=8) == pytest.approx(9.0)
    agree_none = torch.zeros(10, dtype=torch.bool)
    assert demo_eval.tokens_per_pass([agree_none]) == pytest.approx(1.0)
    # Two branches: the target follows whichever chain agrees longer.
    a = torch.tensor([1, 0, 0, 0], dtype=torch.bool)
    b = torch.tensor([1, 1, 1, 0], dtype=torch.bool)
    assert demo_eval.tokens_per_pass([a, b], depth=8) == pytest.approx(4 / 1)
    assert demo_eval.mean_run(torch.tensor([1, 1, 0, 1], dtype=torch.bool)) == pytest.approx((2 + 1 + 0 + 1) / 4)


@pytest.mark.slow
def test_quick_run_writes_a_complete_family(tmp_path, capsys):
    import train_demo_family

    summary = train_demo_family.main(["--quick", "--out", str(tmp_path)])
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last_line)["models"].keys() == summary["models"].keys()
    assert len(summary["models"]) == 4
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for name in summary["models"]:
        for required in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
            assert f"{name}/{required}" in manifest["files"]
    assert (tmp_path / "MODEL_CARD.md").read_text().count("PSF") >= 1
