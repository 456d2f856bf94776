"""Sampling with a GGUF target: speculative draws follow the target's law (computed from
the `gguf` package's dequantization of the file), checked by chi-square on two tokens."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("gguf")

from minions_local.models.gguf_target import side_folder  # noqa: E402
from tests.helpers.tiny_gguf import write_gguf  # noqa: E402
from tests.helpers.tiny_models import noisy_copy, random_model, save, tiny_config  # noqa: E402
from tests.offload.test_gguf_streamed import reference_model  # noqa: E402


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIONS_CACHE_DIR", str(tmp_path / "cache"))


def two_token_law(model, prompt: list[int], sp) -> dict[tuple[int, int], float]:
    """P(first, second) of `model` sampled with `sp`."""
    from minions_local.core.sampling import processed_probs

    with torch.no_grad():
        p1 = processed_probs(model(torch.tensor([prompt])).logits[0, -1], sp)
        firsts = [int(x) for x in torch.nonzero(p1).flatten()]
        p2 = processed_probs(model(torch.tensor([prompt + [x] for x in firsts])).logits[:, -1], sp)
    return {(x1, int(x2)): float(p1[x1] * p2[i, x2]) for i, x1 in enumerate(firsts)
            for x2 in torch.nonzero(p2[i]).flatten()}


def test_speculative_samples_follow_the_gguf_targets_law(tmp_path, tokenizer, monkeypatch) -> None:
    """The minion's own law is far from the target's (total variation ~0.4), and its
    drafts serve most first steps: a sampler that leaned on the drafts would fail."""
    import minions_local.engine.reply as engine_module
    from minions_local import Engine
    from minions_local.core.sampling import SamplingParams
    from tests.helpers.stats import chi2_pvalue, first_two_tokens

    stream = iter(range(10**6))  # unseeded requests draw their drafts: made repeatable here
    monkeypatch.setattr(engine_module.random, "getrandbits", lambda bits: next(stream))
    config = tiny_config("llama", layers=2)
    target = random_model(config, seed=5, scale=6.0)
    path = write_gguf(save(target, tmp_path / "target", tokenizer), tmp_path / "target.gguf", "Q4_1")
    options = {"cache_dir": str(tmp_path / "packs"), "buffers": 2, "kernel": "dequant"}  # the torch path (llama.cpp: tests/engine/test_llama_engine.py)
    Engine.from_pretrained(path, [], target_tier="disk", stream_options=options)  # writes the side folder
    draft = noisy_copy(target, seed=6, noise=0.2)
    minion = save(draft, tmp_path / "minion")
    for f in side_folder(path).glob("*token*"):
        shutil.copy(f, minion / f.name)
    engine = Engine.from_pretrained(path, [str(minion)], target_tier="disk", budget=6, max_depth=3,
                                    selection="all", stream_options=options)
    prompt = [1, 5, 9, 22, 40, 3]
    sp = SamplingParams(0.8, 1.0, 5)
    expected = two_token_law(reference_model(path, "llama", config), prompt, sp)
    drafts = two_token_law(draft, prompt, sp)
    distance = 0.5 * sum(abs(expected.get(k, 0.0) - drafts.get(k, 0.0)) for k in expected.keys() | drafts.keys())
    assert distance > 0.25
    n = 800
    seen, drafted = first_two_tokens(engine, prompt, n, temperature=0.8, top_k=5)
    assert drafted > n // 2, "drawn drafts should often serve both tokens in one pass"
    assert chi2_pvalue(seen, expected, n) > 0.001
