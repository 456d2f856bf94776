"""The compact minion forward gives transformers' logits, through tree masks and cache edits."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from minions_local.backends.compact import CompactModel, supports
from minions_local.backends.hf import CachedModel
from minions_local.backends.hf_minion import HFMinion
from minions_local.core.tree import TokenTree
from tests.helpers.rows import assert_rows_are_one_token_passes
from tests.helpers.tiny_models import random_model, tiny_config


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_compact_matches_transformers(families, arch):
    model = AutoModelForCausalLM.from_pretrained(families[arch]["target"]).eval()
    ref, fast = CachedModel(model), CompactModel(model)
    fast.decoder.slot_kv.kv = fast.decoder._alloc(4)  # force the cache to grow by doubling
    prompt = list(range(3, 40))
    assert torch.allclose(ref.extend(prompt), fast.extend(prompt), atol=1e-4)
    tree = TokenTree.from_root(50)
    a = tree.add(0, 51)
    tree.add(0, 52)
    b = tree.add(a, 53)
    args = (tree.tokens, tree.ancestor_matrix(), tree.depths, len(prompt))
    assert torch.allclose(ref.forward(*args), fast.forward(*args), atol=1e-4)
    keep = list(range(len(prompt))) + [len(prompt), len(prompt) + a, len(prompt) + b]
    ref.keep_entries(keep)
    fast.keep_entries(keep)
    one = ([60], np.ones((1, 1), dtype=bool), [0], len(keep))
    assert torch.allclose(ref.forward(*one), fast.forward(*one), atol=1e-4)


def test_qwen2_bias_and_fallbacks():
    qwen = random_model(tiny_config("qwen2"), 0)
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None and supports(qwen)
    windowed = random_model(tiny_config("mistral"), 0)
    windowed.config.sliding_window = 16
    assert not supports(windowed)
    assert type(HFMinion(windowed, "w").runner) is CachedModel
    assert isinstance(HFMinion(qwen, "q").runner, CompactModel) and not HFMinion(qwen, "q").runner.decoder.exact


# -- the resident target on the compact forward -------------------------------------------

from minions_local.backends import hf_target  # noqa: E402
from minions_local.backends.packing import packing_is_exact  # noqa: E402
from minions_local.backends.hf_target import CompactTarget, HFTarget, exact_target  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resident_target_is_exact(dtype):
    """Exactness is the point: in every dtype (transformers' own logits change with the
    batch, in float32 too: MKL's matmuls) each tree row is the target's own 1-token pass,
    bit for bit, close to transformers'; and a prompt's cache entries are the same bits
    however the prompt is chunked."""
    model = random_model(tiny_config("llama"), 3).to(dtype)
    ref = HFTarget(random_model(tiny_config("llama"), 3).to(dtype))
    target = exact_target(model)
    # Which wrapper is a property of the CPU (the load-time check decides); on this
    # project's machines it is the compact one, prepacked in bf16. Either must be exact.
    compact = isinstance(target, CompactTarget)
    assert target.cache_len == 0 and target.cached == []  # the load-time check left nothing behind
    if compact and dtype == torch.bfloat16:
        assert (target.decoder.linear is not torch.nn.functional.linear) == packing_is_exact(dtype, torch.device("cpu"))
    context = list(range(3, 60))
    tree = TokenTree.from_root(context[-1])
    a = tree.add(0, 7)
    tree.add(0, 8)
    tree.add(a, 9)
    for n in (20, 57):  # the second verify runs on a cache the first one left
        theirs, ours = ref.verify(context[:n], tree), target.verify(context[:n], tree)
        if compact:  # row-invariant instead: close to theirs, ...
            assert (ours - theirs).abs().max() <= 0.05 * theirs.abs().max()
        else:
            assert torch.equal(theirs, ours)
        ref.commit(tree, [0, a])
        target.commit(tree, [0, a])
    if compact:  # ... and each row is the 1-token pass's, bit for bit, ...
        assert_rows_are_one_token_passes(target, context, tree)
        target.reset()  # ... and chunking changes no entry
        target.extend(context)
        whole = hf_target.prompt_entries(target, len(context))
        assert not hf_target.chunking_differs(target, context, whole)
    if compact:  # the module's own copies were released: the weights are held once
        assert model.model.layers[0].mlp.gate_proj.weight.numel() == 0
        assert target.weight_bytes() >= sum(p.numel() * p.element_size() for p in ref.model.parameters()) * 0.95


def test_resident_target_falls_back_where_the_compact_forward_is_not_exact(monkeypatch):
    monkeypatch.setattr(hf_target, "_row_invariant", lambda reference, compact, vocab: False)
    model = random_model(tiny_config("llama"), 3)
    target = exact_target(model)
    assert type(target) is HFTarget and model.model.layers[0].mlp.gate_proj.weight.numel() > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_minion_forward_is_close_to_transformers(families, arch):
    """Minions take the cheaper, differently rounded path; it must still be the same model."""
    from minions_local.backends.hf_minion import CompactMinion

    model = AutoModelForCausalLM.from_pretrained(families[arch]["target"]).eval()
    ref, fast = CachedModel(model), CompactMinion(model)
    prompt = list(range(3, 40))
    assert torch.allclose(ref.extend(prompt), fast.extend(prompt), atol=1e-3)
    tree = TokenTree.from_root(50)
    tree.add(tree.add(0, 51), 53)
    args = (tree.tokens, tree.ancestor_matrix(), tree.depths, len(prompt))
    assert torch.allclose(ref.forward(*args), fast.forward(*args), atol=1e-3)


def test_loaded_minions_hold_their_weights_once(monkeypatch):
    """The loader's minions give the module copies back; a big tied head stays shared."""
    from minions_local.backends import compact

    model = random_model(tiny_config("llama"), 5).to(torch.bfloat16)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as small Llama 3 models are
    plain = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(compact, "TIED_HEAD_COPY", 0)  # every tied head counts as big here
    minion = HFMinion(model, "m", release_weights=True)
    decoder = minion.runner.decoder
    assert model.model.layers[0].self_attn.q_proj.weight.numel() == 0
    assert decoder.lm_head is decoder.embed
    if decoder.linear is not torch.nn.functional.linear:  # packed matmuls (where exact on this CPU)
        assert decoder.head_linear is torch.nn.functional.linear
    assert minion.weight_bytes() == pytest.approx(plain, rel=0.05)
    logits = minion.runner.extend(list(range(3, 20)))
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()


@pytest.mark.parametrize("runner", [CachedModel, CompactModel])
def test_prefill_computes_the_head_on_its_last_row_only(runner):
    """A prefill's logits are only read at its last row: the head runs on that row alone,
    and it is the row a full pass gives; the cache and features are the same either way."""
    model = random_model(tiny_config("llama"), 3).eval()
    full, last = runner(model), runner(model)
    full.keep_hidden = last.keep_hidden = True
    prompt = list(range(3, 40))
    chain = np.tril(np.ones((len(prompt), len(prompt)), dtype=bool))
    every_row = full.forward(prompt, chain, list(range(len(prompt))), 0)
    only_last = last.forward(prompt, chain, list(range(len(prompt))), 0, prefill=True)
    assert every_row.shape[0] == len(prompt) and only_last.shape[0] == 1
    assert torch.allclose(every_row[-1:], only_last, atol=1e-5)
    assert torch.allclose(full.last_hidden, last.last_hidden, atol=1e-6)
    one = ([60], np.ones((1, 1), dtype=bool), [0], len(prompt))
    assert torch.allclose(full.forward(*one), last.forward(*one), atol=1e-5)
    assert last.extend([61, 62, 63]).shape == (1, model.config.vocab_size)


def test_the_chunking_check_finds_a_prompt_attention_that_depends_on_the_chunk(monkeypatch):
    """The load check must be able to fail: here a 1-token chunk's attention rounds
    otherwise (as torch's fused kernel does for some chunk lengths)."""
    from minions_local.backends import compact

    target = exact_target(random_model(tiny_config("llama"), 3).to(torch.bfloat16))
    assert isinstance(target, CompactTarget)
    context = list(range(3, 40))
    target.extend(context)
    whole = hf_target.prompt_entries(target, len(context))
    real = compact.attend_prompt
    monkeypatch.setattr(compact, "attend_prompt",
                        lambda q, k, v, start: real(q, k, v, start) * (1 + 2 ** -6 * (q.shape[2] == 1)))
    assert hf_target.chunking_differs(target, context, whole)
