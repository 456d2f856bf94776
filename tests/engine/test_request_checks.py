"""Every argument of generate / chat / stream is checked before any work, and a bad one
raises RequestError naming the argument, the value and what is allowed."""

import numpy as np
import pytest
import torch

from minions_local import Engine
from minions_local.core.errors import ContextOverflowError, RequestError
from tests.helpers.tiny_models import hf_greedy

PROMPT = [4, 5, 6]


@pytest.fixture(scope="module")
def engine(families):
    fam = families["llama"]
    return Engine.from_pretrained(fam["target"], [fam["close"]], budget=8)


@pytest.fixture(scope="module")
def reference(families):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(families["llama"]["target"]).eval()
    return hf_greedy(model, PROMPT, 10)


@pytest.fixture
def no_work(engine, monkeypatch):
    """Fails the test if the request reaches the model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model ran for a request that should have been refused")

    monkeypatch.setattr(engine.decoder, "step_shared", refuse)  # every pass, a prompt's too
    monkeypatch.setattr(engine.decoder, "prefill_minions", refuse)


BAD_ARGUMENTS = [
    ("temperature", float("nan"), "finite"),
    ("temperature", float("inf"), "finite"),
    ("temperature", -0.5, "0 for greedy"),
    ("temperature", 1e-9, "from 0.001 to 100"),
    ("temperature", 1e6, "from 0.001 to 100"),
    ("temperature", "0.7", "must be a number"),
    ("temperature", True, "must be a number"),
    ("temperature", 10**400, "finite"),
    ("top_p", 0.0, "greater than 0 and at most 1"),
    ("top_p", 1.5, "greater than 0 and at most 1"),
    ("top_p", float("nan"), "finite"),
    ("top_p", None, "must be a number"),
    ("top_k", -1, ">= 0"),
    ("top_k", 2.0, "whole number"),
    ("max_new_tokens", "5", "whole number"),
    ("max_new_tokens", 2.5, "whole number"),
    ("max_new_tokens", 3.0, "whole number"),
    ("max_new_tokens", True, "whole number"),
    ("max_new_tokens", 0, "1 or more"),
    ("max_new_tokens", -3, "1 or more"),
    ("seed", "x", "whole number"),
    ("seed", 2**70, "2\\*\\*64 - 1"),
    ("seed", -1, "from 0"),
    ("seed", 1.5, "whole number"),
    ("seed", False, "whole number"),
    ("stop", [None], "list of strings"),
    ("stop", [""], "must not be empty"),
    ("stop", 5, "a string or a list of strings"),
    ("stop", b"ab", "a string or a list of strings"),
    ("stop", ["\udcff"], "lone surrogate"),
]


@pytest.mark.parametrize("name, value, allowed", BAD_ARGUMENTS, ids=[f"{n}={v!r}" for n, v, _ in BAD_ARGUMENTS])
def test_bad_argument_is_named_with_value_and_range(engine, no_work, name, value, allowed):
    with pytest.raises(RequestError, match=allowed) as err:
        engine.generate(PROMPT, **{name: value})
    assert err.value.argument == name
    assert name in str(err.value)
    if not isinstance(value, (list, bytes)):
        assert repr(value)[:20] in str(err.value) or str(value)[:20] in str(err.value)


BAD_PROMPTS = [
    ([1.5, 2], "position 0 holds 1.5"),
    ([4, True], "position 1 holds True"),
    ([4, "5"], "position 1 holds '5'"),
    ([4, 10_000], "outside the target's vocabulary \\(0..95\\)"),
    ([-1], "outside the target's vocabulary"),
    (b"hello", "bytes"),
    (5, "text or a list of token ids"),
    ({"a": 1}, "text or a list of token ids"),
    ("def \udcff(", "character 4 is a lone surrogate"),
    (b"caf\xe9".decode("utf-8", "surrogateescape"), "lone surrogate"),
]


@pytest.mark.parametrize("prompt, message", BAD_PROMPTS, ids=[repr(p)[:20] for p, _ in BAD_PROMPTS])
def test_bad_prompt_is_refused_before_work(engine, no_work, prompt, message):
    with pytest.raises(RequestError, match=message) as err:
        engine.generate(prompt, max_new_tokens=3)
    assert err.value.argument == "prompt"


def test_whole_numbers_from_numpy_and_torch_are_fine(engine, reference):
    ids = [np.int64(4), torch.tensor(5), 6]
    out = engine.generate(ids, max_new_tokens=np.int32(10), seed=np.uint64(3), top_k=np.int8(0))
    assert out.token_ids == reference
    assert engine.generate(torch.tensor(PROMPT), max_new_tokens=10).token_ids == reference


def test_empty_prompt_starts_from_bos_id(engine, tokenizer):
    assert tokenizer.bos_token_id == 1
    from_empty = engine.generate("", max_new_tokens=4).token_ids
    assert engine.generate([], max_new_tokens=4).token_ids == from_empty
    assert engine.generate([1], max_new_tokens=4).token_ids == from_empty


def test_empty_prompt_with_bos_id_zero(engine, monkeypatch):
    """Id 0 is a token like any other (the shipped demo family's BOS is 0)."""
    monkeypatch.setattr(engine.tokenizer, "bos_token_id", 0, raising=False)
    assert engine._start_token() == 0
    assert engine.generate("", max_new_tokens=3).token_ids == engine.generate([0], max_new_tokens=3).token_ids


def test_empty_prompt_without_bos_is_a_request_error(engine, no_work, monkeypatch):
    monkeypatch.setattr(engine, "_start_token", lambda: None)
    with pytest.raises(RequestError, match="empty and this model has no BOS"):
        engine.generate([], max_new_tokens=3)


def test_max_new_tokens_none_fills_the_context(engine):
    out = engine.generate([5] * 250, max_new_tokens=None)
    assert len(out.token_ids) <= 6
    with pytest.raises(ContextOverflowError, match="leaves 0 of the target's context window of 256"):
        engine.generate([5] * 256, max_new_tokens=None)


BAD_MESSAGES = [
    ([], "messages is empty"),
    ("hello", "list of"),
    ({"role": "user", "content": "x"}, "list of"),
    ([{"role": "user"}], "'role' and 'content'"),
    (["hello"], "'role' and 'content'"),
    ([{"role": None, "content": "x"}], "non-empty string"),
    ([{"role": "", "content": "x"}], "non-empty string"),
    ([{"role": "user", "content": None}], "must be a string"),
    ([{"role": "user", "content": ["x"]}], "must be a string"),
    ([{"role": "user", "content": "a\udc80b"}], "messages\\[0\\]\\['content'\\] is not valid Unicode"),
]


@pytest.mark.parametrize("messages, message", BAD_MESSAGES, ids=[repr(m)[:24] for m, _ in BAD_MESSAGES])
def test_bad_messages_are_refused_before_work(engine, no_work, messages, message):
    with pytest.raises(RequestError, match=message) as err:
        engine.chat(messages, max_new_tokens=3)
    assert err.value.argument == "messages"


def test_a_template_that_refuses_the_conversation_is_a_request_error(engine, no_work, monkeypatch):
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with "
                "the user') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    with pytest.raises(RequestError, match="refused these messages: Conversations must start with the user"):
        engine.chat([{"role": "assistant", "content": "hi"}], max_new_tokens=3)


def test_checks_leave_the_engine_giving_the_reference(engine, reference):
    for name, value, _ in BAD_ARGUMENTS:
        with pytest.raises(RequestError):
            engine.generate(PROMPT, **{name: value})
    assert engine.generate(PROMPT, max_new_tokens=10).token_ids == reference
