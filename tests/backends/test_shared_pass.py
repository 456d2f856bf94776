"""Several requests' trees in one target pass: each request's logits are what a pass
of its own gives (bf16, row-invariant: bit for bit; float32: to the last bit of MKL's
small-batch kernels), resident or streamed; each request keeps its own cache (slot),
and commits stay per request."""

from __future__ import annotations

import pytest
import torch

from minions_local.backends.hf_target import SharedPassTarget, exact_target
from minions_local.core.protocols import PromptChunk, SlotTree
from minions_local.core.tree import TokenTree
from minions_local.offload import load_streamed_causal_lm
from tests.helpers.offload_helpers import one_thread, resident, save_tiny


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _random_tree(root: int, nodes: int, vocab: int, g: torch.Generator) -> TokenTree:
    tree = TokenTree.from_root(root)
    for _ in range(nodes):
        tree.add(int(torch.randint(0, len(tree), (1,), generator=g)), int(torch.randint(3, vocab, (1,), generator=g)))
    return tree


def _requests(vocab: int, seed: int = 0) -> list[tuple[list[int], TokenTree]]:
    """Contexts of different lengths, trees of different sizes (one bare root)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length, nodes in ((5, 6), (17, 0), (9, 11), (30, 3)):
        context = [int(t) for t in torch.randint(3, vocab, (length,), generator=g)]
        out.append((context, _random_tree(context[-1], nodes, vocab, g)))
    return out


def _target(tmp_path, dtype, tier):
    path = save_tiny(tmp_path, "llama", layers=3)
    if tier == "device":
        return exact_target(resident(path, dtype), release_weights=False)
    model, stats = load_streamed_causal_lm(path, dtype=dtype, cache_dir=tmp_path / "pack", buffers=2, tier=tier)
    return exact_target(model, bytes_streamed=lambda: stats.bytes_streamed, release_weights=False)


def _alone(target, slot: int, context: list[int], tree: TokenTree) -> torch.Tensor:
    target.use_slot(slot)
    return target.verify(context, tree)


@pytest.mark.parametrize("dtype, tier", [
    (torch.float32, "device"), (torch.bfloat16, "device"), (torch.float32, "disk"), (torch.bfloat16, "ram"),
])
def test_shared_pass_gives_each_request_its_own_logits(tmp_path, dtype, tier):
    target = _target(tmp_path, dtype, tier)
    assert isinstance(target, SharedPassTarget) and target.shares_passes
    vocab = target.vocab_size
    requests = _requests(vocab)
    for round_ in range(2):  # the second round runs on the caches the first round's commits left
        shared = target.verify_batch([SlotTree(1 + i, c, t) for i, (c, t) in enumerate(requests)])
        alone = [_alone(target, 11 + i, c, t) for i, (c, t) in enumerate(requests)]
        for i, (a, b) in enumerate(zip(shared, alone)):
            if dtype == torch.float32:
                # MKL rounds a matmul of 1-11 rows (alone: a small tree) in other
                # kernels than a batch's; a last-bit difference, never a new argmax here.
                assert torch.allclose(a, b, rtol=0, atol=1e-5) and torch.equal(a.argmax(-1), b.argmax(-1))
            else:  # row-invariant: bit for bit
                assert torch.equal(a, b), f"request {i}, round {round_}: shared pass differs by {(a - b).abs().max()}"
        g = torch.Generator().manual_seed(round_)
        nxt = []
        for i, (context, tree) in enumerate(requests):
            node = int(torch.randint(0, len(tree), (1,), generator=g))
            path = [node]
            while path[-1] != 0:
                path.append(tree.parents[path[-1]])
            path.reverse()
            for slot in (1 + i, 11 + i):
                target.use_slot(slot)
                target.commit(tree, path)
            context = context + [tree.tokens[n] for n in path[1:]] + [int(shared[i][path[-1]].argmax())]
            nxt.append((context, _random_tree(context[-1], 5 + i, vocab, g)))
        requests = nxt


def test_slots_keep_their_own_caches(tmp_path):
    target = _target(tmp_path, torch.float32, "device")
    vocab = target.vocab_size
    (c0, t0), (c1, t1) = _requests(vocab)[:2]
    target.use_slot(0)
    before = target.verify(c0, t0)
    target.commit(t0, [0])
    cached0 = list(target.cached)
    target.verify_batch([SlotTree(1, c1, t1), SlotTree(2, c1, t1)])
    target.use_slot(0)
    assert target.cached == cached0  # slot 0 (the conversation) untouched by the batch
    target.drop_slot(1)
    assert 1 not in target.slots_held() and 2 in target.slots_held()
    target.use_slot(1)
    assert target.cached == [] and target.cache_len == 0  # a dropped slot starts fresh
    target.use_slot(3)
    target.reset()
    assert torch.equal(_alone(target, 4, c0, t0), before)


def _entries(target, slot: int, n: int) -> torch.Tensor:
    target.use_slot(slot)
    return target.decoder.slot_kv.kv[:, :, :, :n].clone()


@pytest.mark.parametrize("dtype, tier", [(torch.float32, "device"), (torch.bfloat16, "disk")])
def test_a_prompt_borrows_the_prefix_another_slot_read_and_gets_the_same_bits(tmp_path, dtype, tier):
    target = _target(tmp_path, dtype, tier)
    g = torch.Generator().manual_seed(3)
    system = [int(t) for t in torch.randint(3, target.vocab_size, (21,), generator=g)]
    first = system + [int(t) for t in torch.randint(3, target.vocab_size, (7,), generator=g)]
    second = system + [int(t) for t in torch.randint(3, target.vocab_size, (12,), generator=g)]
    target.use_slot(1)
    target.prefill(first)
    target.use_slot(2)
    missing = target.missing_prompt(second)
    assert missing == second[len(system):-1]  # the shared prefix was lent, not read
    target.verify_batch([], [PromptChunk(2, missing)])
    lent = _entries(target, 2, len(second) - 1)
    target.drop_slot(1)
    target.drop_slot(2)
    target.use_slot(3)  # nobody left to lend: read from an empty cache
    assert target.missing_prompt(second) == second[:-1]
    target.prefill(second)
    assert torch.equal(_entries(target, 3, len(second) - 1), lent)


def test_decoded_entries_are_never_lent(tmp_path):
    target = _target(tmp_path, torch.bfloat16, "device")
    (context, tree), = _requests(target.vocab_size)[2:3]
    target.use_slot(1)
    target.verify(context, tree)
    path = [0, *[n for n in range(1, len(tree)) if tree.parents[n] == 0][:1]]
    target.commit(tree, path)  # slot 1 now holds the prompt, the root and a decoded token
    decoded = [tree.tokens[n] for n in path]
    later = context[:-1] + decoded + [5, 6, 7]
    target.use_slot(2)
    assert target.missing_prompt(later) == later[len(context) - 1:-1]  # only the prompt's entries
