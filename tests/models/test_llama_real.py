"""A real K-quant GGUF target end to end on llama.cpp: SmolLM2 padded into a wider shape
whose every layer matrix is Q4_K or Q6_K (benchmarks/padded_gguf.py 'small', 174 MB,
built here in ~12 s), drafted by the shipped SmolLM2 Q4_1 file and n-gram, as a newcomer
runs it (`Engine.from_profile("cpu-demo", target=..., minions=...)`). Greedy chat replies through
trees equal the target's own, and sampled first tokens follow its law."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [pytest.mark.gguf, pytest.mark.realmodel]

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    from tests.models.conftest import require_wheel

    require_wheel()
    from benchmarks.padded_gguf import padded_gguf

    return padded_gguf("small", "q4_k_m", folder=tmp_path_factory.mktemp("padded"))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIONS_CACHE_DIR", str(tmp_path / "cache"))


QUESTIONS = ["What is the capital of France? Answer in one sentence.",
             "Write a Python function that adds two numbers."]


def test_greedy_chat_through_trees_is_the_targets_own(small_target):
    from benchmarks.padded_gguf import source_gguf
    from minions_local import Engine
    from minions_local.backends.llama_target import LlamaTarget
    from minions_local.models.gguf_file import read_model

    types = {t.type_name for f in read_model(small_target).files for name, t in f.tensors.items()
             if name.startswith("blk.") and len(t.shape) == 2}
    assert types <= {"Q4_K", "Q6_K"}  # every layer matrix a K-quant: ggml's tiled kernel, forced
    # A fixed tree budget: the adaptive policy may price trees out on a busy machine (its
    # choice rides on timings), and this test is about the replies trees give.
    engine = Engine.from_profile("cpu-demo", target=str(small_target), minions=[str(source_gguf()), "ngram"],
                                 budget=16, max_depth=6)
    alone = Engine.from_profile("cpu-demo", target=str(small_target), minions=[])
    assert isinstance(engine.decoder.target, LlamaTarget)
    tokens = passes = 0
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        engine.reset()
        alone.reset()
        got = engine.chat(messages, max_new_tokens=40)
        assert got.token_ids == alone.chat(messages, max_new_tokens=40).token_ids
        tokens, passes = tokens + len(got.token_ids), passes + len(got.steps)
        if question == QUESTIONS[0]:
            assert "Paris" in got.text
    assert tokens / passes > 1.3  # the trees were accepted (the draft is SmolLM2 quantized otherwise)


def test_sampled_first_tokens_follow_the_targets_law(small_target, monkeypatch):
    import minions_local.engine.reply as reply_module
    from benchmarks.padded_gguf import source_gguf
    from minions_local import Engine
    from minions_local.core.sampling import SamplingParams
    from tests.helpers.stats import chi2_pvalue, first_two_tokens, two_token_law

    stream = iter(range(10**6))  # unseeded requests draw their drafts: made repeatable here
    monkeypatch.setattr(reply_module.random, "getrandbits", lambda bits: next(stream))
    # A fixed tree budget: with the patched ggml a lone row is cheap, and the adaptive policy
    # may then decode without trees; this test is about the law of the replies trees give.
    engine = Engine.from_profile("cpu-demo", target=str(small_target), minions=[str(source_gguf())],
                                 budget=8, max_depth=4)
    prompt = engine.prepare_chat([{"role": "user", "content": "Name a colour."}]).ids
    sp = SamplingParams(1.0, 1.0, 3)
    expected = two_token_law(engine.decoder.target, prompt, sp)
    engine.reset()
    observed, drafted = first_two_tokens(engine, prompt, 300, temperature=1.0, top_k=3)
    assert drafted > 30
    assert chi2_pvalue(observed, expected, 300) > 1e-3


def test_the_interleaved_copy_gives_the_file_layouts_bits(small_target):
    """A model held in RAM takes its Q4_K matrices interleaved at load (llama_target.py,
    the patched ggml's GGML_CPU_TILED_REPACK): a prompt's rows (a pass of 63, the tiles over
    rows put back in the file's layout), a tree's (the 16-row form over the copy) and a lone
    row get the bits they get over the file's own layout."""
    from pathlib import Path

    import llama_cpp
    import numpy as np

    from minions_local.backends.llama_context import log_lines
    from minions_local.backends.llama_target import LlamaTarget
    from minions_local.core.tree import TokenTree

    g = np.random.default_rng(3)
    prompt = [int(t) for t in g.integers(0, 49152, 80)]
    tree = TokenTree.from_root(prompt[-1])
    for _ in range(12):
        tree.add(int(g.integers(0, len(tree))), int(g.integers(0, 49152)), score=float(g.random()))
    logits, said = {}, {}
    for interleave in (False, True):
        with log_lines() as lines:
            target = LlamaTarget(small_target, n_ctx=512, threads=2, interleave=interleave)
        try:
            target.use_slot(0)
            target.reset()
            whole = target.verify(prompt, tree).numpy().copy()
            target.reset()
            target.prefill(prompt)  # all but the root
            lone = target.verify(prompt, TokenTree.from_root(prompt[-1])).numpy().copy()
        finally:
            target.close()
        logits[interleave], said[interleave] = (whole, lone), "".join(lines)
    stamp = Path(llama_cpp.__file__).parent / ".minions-build"
    if "avx512_vnni" in (stamp.read_text() if stamp.is_file() else ""):  # the copy's kernel is VNNI's
        assert "CPU_REPACK" in said[True] and "CPU_REPACK" not in said[False]
    np.testing.assert_array_equal(logits[True][0], logits[False][0])
    np.testing.assert_array_equal(logits[True][1], logits[False][1])
    np.testing.assert_array_equal(logits[True][1][0], logits[True][0][0])  # the lone row: the tree's root's bits
