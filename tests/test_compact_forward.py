"""The compact minion forward gives transformers' logits, through tree masks and cache edits."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from minions_local.backends.compact import CompactModel, supports
from minions_local.backends.hf import CachedModel
from minions_local.backends.hf_minion import HFMinion
from minions_local.speculation.tree import TokenTree
from tiny_models import random_model, tiny_config


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_compact_matches_transformers(families, arch):
    model = AutoModelForCausalLM.from_pretrained(families[arch]["target"]).eval()
    ref, fast = CachedModel(model), CompactModel(model)
    fast.decoder.kv = fast.decoder._alloc(4)  # force the cache to grow by doubling
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
    assert type(HFMinion(qwen, "q").runner) is CompactModel
