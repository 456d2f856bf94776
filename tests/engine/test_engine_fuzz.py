"""Random arguments and text, invalid UTF-8 included, thrown at generate and chat: only
MinionsError subclasses come out, and the engine still gives the reference afterwards."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minions_local import Engine
from minions_local.core.errors import MinionsError
from minions_local.core.events import Generation
from tests.helpers.tiny_models import hf_greedy

REFERENCE_PROMPT = [7, 8, 9, 10]
N = 8

junk = st.one_of(
    st.none(), st.booleans(), st.text(max_size=4), st.binary(max_size=4),
    st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.just(2**70), st.just(-(2**70)),
    st.lists(st.integers(-2, 2), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)
# Text as a careless or hostile user sends it: any bytes decoded with surrogateescape
# (so invalid UTF-8 becomes lone surrogates), any code points, or the tokenizer's own.
text = st.one_of(
    st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.text(max_size=40),
    st.text(alphabet="def add(a, b):\n return hello world,minions", max_size=40),
)
token_ids = st.lists(st.one_of(st.integers(0, 95), st.integers(), st.floats(), st.booleans(), st.text(max_size=1)),
                     max_size=12)
kwargs = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.one_of(st.integers(1, 12), st.integers(-3, 0), st.integers(), st.floats(0, 20), junk),
    "temperature": st.one_of(st.just(0.0), st.floats(0, 3), st.floats(), junk),
    "top_p": st.one_of(st.floats(0, 1), st.floats(), junk),
    "top_k": st.one_of(st.integers(0, 100), st.integers(), junk),
    "seed": st.one_of(st.integers(0, 2**64 - 1), st.integers(), junk),
    "stop": st.one_of(text, st.lists(st.one_of(text, junk), max_size=3), junk),
})
messages = st.lists(
    st.one_of(
        st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system"]), text, junk),
                               "content": st.one_of(text, junk)}),
        text, junk,
    ),
    max_size=4,
)
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def engine(families):
    fam = families["llama"]
    return Engine.from_pretrained(fam["target"], [fam["close"], "ngram"], budget=8)


@pytest.fixture(scope="module")
def reference(families):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(families["llama"]["target"]).eval()
    return hf_greedy(model, REFERENCE_PROMPT, N)


def _check(run, engine, reference):
    try:
        out = run()
    except MinionsError as err:
        assert str(err) and "Traceback" not in str(err)
    else:
        assert isinstance(out, Generation) and out.finish_reason in ("length", "stop")
        assert all(isinstance(t, int) for t in out.token_ids) and isinstance(out.text, str)
    assert engine.generate(REFERENCE_PROMPT, max_new_tokens=N).token_ids == reference


@SETTINGS
@given(prompt=st.one_of(text, token_ids, junk), args=kwargs)
def test_generate_with_random_arguments(engine, reference, prompt, args):
    _check(lambda: engine.generate(prompt, **args), engine, reference)


@SETTINGS
@given(conversation=st.one_of(messages, junk), args=kwargs)
def test_chat_with_random_messages_and_arguments(engine, reference, conversation, args):
    _check(lambda: engine.chat(conversation, **args), engine, reference)


@settings(max_examples=60, deadline=None)
@given(temperature=st.floats(min_value=1e-3, max_value=100), top_p=st.floats(min_value=1e-6, max_value=1),
       top_k=st.integers(0, 200), seed=st.integers(0, 2**64 - 1))
def test_every_allowed_sampling_setting_generates(engine, reference, temperature, top_p, top_k, seed):
    """The allowed ranges are really allowed: no NaN from a tiny temperature or top_p."""
    out = engine.generate([5, 6], max_new_tokens=4, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    assert len(out.token_ids) >= 1 and all(0 <= t < 96 for t in out.token_ids)
    assert engine.generate(REFERENCE_PROMPT, max_new_tokens=N).token_ids == reference
