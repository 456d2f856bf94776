"""The shipped SmolLM2 Q4_1 GGUF as the target, streamed from disk as its own blocks:
a greedy chat reply with minions drafting is the GGUF target's own autoregressive reply."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.realmodel


@pytest.mark.parametrize("kernel", ["int4", "dequant"])
def test_shipped_gguf_streams_as_blocks_and_speculation_stays_exact(kernel, tmp_path, monkeypatch) -> None:
    from tests.models.conftest import require_wheel

    require_wheel()
    monkeypatch.setenv("MINIONS_CACHE_DIR", str(tmp_path / "cache"))
    from minions_local import Engine
    from minions_local.offload.binding import uses_int4_kernel
    from minions_local.profile.loader import resolve_model_path

    path = resolve_model_path("builtin:smollm2-135m-instruct.gguf")  # the wheel's file, as profiles name it
    options = {"cache_dir": str(tmp_path / "packs"), "buffers": 4, "kernel": kernel}
    alone = Engine.from_pretrained(path, [], target_tier="disk", stream_options=options)
    assert uses_int4_kernel(alone.decoder.target.model) == (kernel == "int4")  # every layer matrix is Q4_1
    stats = alone.decoder.target.stream_stats
    assert 60e6 < stats.bytes_per_pass < 0.45 * 212e6  # the goal: <= 0.45 of the bf16 layers
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    want = alone.generate(alone.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                          max_new_tokens=16)
    assert want.text.strip()
    speculative = Engine.from_pretrained(path, ["ngram"], target_tier="disk", budget=8, stream_options=options)
    got = speculative.generate(alone.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=False), max_new_tokens=16)
    assert got.token_ids == want.token_ids
