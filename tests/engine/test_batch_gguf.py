"""A batch whose minions include a llama.cpp one: the requests' trees grow together
(speculation/growing.py: one grow_batch per round, one llama.cpp pass per tree level
for all of them), in a context shared by the batch's slots, and every greedy reply is
still the target's own."""

from __future__ import annotations

import torch

from minions_local import Engine
from minions_local.backends.gguf_export import export_gguf
from tests.backends.test_gguf import VOCAB, bpe_tokenizer, needs_llama_cpp  # noqa: F401 (a fixture)
from tests.helpers.tiny_models import noisy_copy, random_model, save, tiny_config


@needs_llama_cpp
def test_batch_trees_grow_in_shared_llama_cpp_passes(tmp_path, bpe_tokenizer, monkeypatch):  # noqa: F811
    from minions_local.backends.gguf import GGUFMinion

    target = random_model(tiny_config("llama", vocab=VOCAB, layers=3), seed=5, scale=25.0)
    target_dir = save(target, tmp_path / "target", bpe_tokenizer)
    close_dir = save(noisy_copy(target, seed=6, noise=0.05), tmp_path / "close", bpe_tokenizer)
    close_gguf = export_gguf(close_dir, tmp_path / "close-q8_0.gguf", type="q8_0")
    engine = Engine.from_pretrained(target_dir, [str(close_gguf), "ngram"], dtype="float32", budget=8, max_depth=4)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 12, (5,), generator=g)]
    references = [target.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=1,
                                  eos_token_id=bpe_tokenizer.eos_token_id)[0, len(p):].tolist() for p in prompts]

    sizes, blocks = [], []
    grow_batch, new_context = GGUFMinion.grow_batch, GGUFMinion._new_context
    monkeypatch.setattr(GGUFMinion, "grow_batch", lambda self, reqs: sizes.append(len(reqs)) or grow_batch(self, reqs))
    monkeypatch.setattr(GGUFMinion, "_new_context", lambda self, n: blocks.append(n) or new_context(self, n))
    batch = engine.generate_batch(prompts, max_new_tokens=24, parallel=4)

    assert [b.token_ids for b in batch] == references
    assert max(sizes) == 4  # four requests' trees in one grow
    assert blocks == [4]  # the batch's four slots share one context (the fifth request reuses a freed slot)
    assert sum(s.accepted for b in batch for s in b.steps) > 0
