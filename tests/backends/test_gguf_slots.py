"""Requests on slots of one llama.cpp minion (core/slots.py): each slot is its own
context on the shared model, so interleaved requests grow exactly the trees they would
grow alone, dropping a slot frees its context, and slot 0 keeps its cache."""

from __future__ import annotations

from pathlib import Path

import pytest

import minions_local
from minions_local.backends.gguf_export import export_gguf
from minions_local.core.protocols import GrowBudget
from tests.helpers.slots import Request, alone, batched, interleaved

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
pytestmark = pytest.mark.gguf

DEMO = Path(minions_local.__file__).parent / "demo_models" / "minion-qwen2-xs"
TEXT = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over", "import json\nimport os\n"]
N_CTX = 512


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory) -> Path:
    return export_gguf(DEMO, tmp_path_factory.mktemp("slots") / "qwen2-xs-f32.gguf", type="f32")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    return [tokenizer.encode(text, add_special_tokens=False).ids for text in TEXT]


def _minion(path: Path):
    from minions_local.backends.gguf import GGUFMinion

    return GGUFMinion(path, n_ctx=N_CTX)


class ContextCount:
    """llama.cpp's C API with its live contexts counted."""

    def __init__(self, lib, live: int) -> None:
        self._lib, self.live = lib, live

    def __getattr__(self, name: str):
        return getattr(self._lib, name)

    def llama_init_from_model(self, model, params):
        ctx = self._lib.llama_init_from_model(model, params)
        self.live += bool(ctx)
        return ctx

    def llama_free(self, ctx) -> None:
        self.live -= 1
        self._lib.llama_free(ctx)


def test_interleaved_requests_grow_what_they_grow_alone(demo_gguf, prompts):
    """Three requests (the conversation on slot 0, two batch requests) taking turns
    phase by phase, growing ahead and carrying subtrees into their next steps: every
    tree equals, token for token and bit for bit, the tree a minion of its own grows."""
    budget, ahead = GrowBudget(max_nodes=10, max_depth=4, width=3, top_k=3), GrowBudget(24, 6, width=3, top_k=3)
    requests = {slot: Request(prompt, steps=4, budget=budget, ahead=ahead) for slot, prompt in enumerate(prompts)}
    separate = [_minion(demo_gguf) for _ in requests]
    expected = {slot: alone(lambda: separate[slot], r) for slot, r in requests.items()}
    minion = _minion(demo_gguf)
    got = interleaved(minion, requests)
    assert got == expected
    assert all(len(tree[0]) == budget.max_nodes for trees in got.values() for tree in trees)
    assert minion.carries == sum(m.carries for m in separate) > 0  # ahead state travelled with its slot
    minion.use_slot(0)
    assert minion._request.prefix[:len(prompts[0])] == prompts[0]  # the conversation's cache is still there
    minion.close()


def test_a_dropped_slot_frees_its_context_and_starts_fresh(demo_gguf, prompts, monkeypatch):
    from minions_local.backends import llama_context

    lib = ContextCount(llama_context.import_llama_cpp(), live=0)
    monkeypatch.setattr(llama_context, "_llama", lib)
    minion = _minion(demo_gguf)
    assert lib.live == 1
    budget = GrowBudget(max_nodes=8, max_depth=3, width=2, top_k=3)
    conversation = minion.grow(prompts[0], budget)
    for slot, prompt in ((1, prompts[1]), (2, prompts[2])):
        minion.use_slot(slot)
        minion.grow(prompt, budget)
    assert lib.live == 3 and minion.slots_held() == [0, 1, 2]
    minion.drop_slot(1)
    assert lib.live == 2 and minion.slots_held() == [0, 2]
    minion.use_slot(1)  # a new request on the freed slot: a new, empty context
    assert lib.live == 3 and minion._request.prefix == [] and minion._request.tree is None
    fresh = _minion(demo_gguf).grow(prompts[2], budget)
    again = minion.grow(prompts[2], budget)
    assert (again.tokens, again.parents, again.logprobs) == (fresh.tokens, fresh.parents, fresh.logprobs)
    minion.drop_slot(1)  # the slot in use: emptied, its context kept for the next request
    assert lib.live == 3 and minion._request.prefix == [] and minion.slot == 1
    minion.use_slot(0)
    assert minion._request.prefix == prompts[0] and len(minion._request.tree) >= len(conversation)
    minion.close()
    assert lib.live == 0 and minion.slots_held() == [0]


def test_slot_bytes_is_what_one_context_allocates(demo_gguf):
    """The KV part is n_ctx x layers x (keys + values) in f16; fewer tree sequences
    mean fewer logits rows, so a smaller slot."""
    import json

    from minions_local.backends.gguf import GGUFMinion

    config = json.loads((DEMO / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv = N_CTX * config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 2
    minion = _minion(demo_gguf)
    assert minion._context_buffers["KV"] == kv
    assert minion._context_buffers["output"] == 256 * config["vocab_size"] * 4  # a logits row per sequence
    assert minion._context_buffers["compute"] > 0
    assert minion.slot_bytes() == sum(minion._context_buffers.values())
    narrow = GGUFMinion(demo_gguf, n_ctx=N_CTX, tree_runs=15)
    assert narrow._context_buffers["output"] == 16 * config["vocab_size"] * 4
    assert narrow.slot_bytes() < minion.slot_bytes()
    shared = GGUFMinion(demo_gguf, n_ctx=N_CTX, requests_per_context=4)  # logits and compute paid once
    assert shared._context_buffers["KV"] == 4 * kv
    assert shared._context_buffers["output"] == 256 * config["vocab_size"] * 4
    assert shared.slot_bytes() == -(-sum(shared._context_buffers.values()) // 4) < minion.slot_bytes()
    for m in (minion, narrow, shared):
        m.close()


@pytest.mark.parametrize("per_context", [1, 3])
def test_a_batched_grow_grows_what_each_request_grows_alone(demo_gguf, prompts, per_context):
    """Requests sharing a context (their sequence ids split between them) and its passes:
    each tree is the one a minion of its own grows, the shorter request leaving early,
    the ahead-grown subtrees carried. A context of its own gives bit-identical trees;
    a shared pass has more rows, for which llama.cpp may sum in another order: the
    log-probabilities then agree to float32 rounding (measured: 6e-5 at -6.2)."""
    from minions_local.backends.gguf import GGUFMinion

    budget, ahead = GrowBudget(max_nodes=10, max_depth=4, width=3, top_k=3), GrowBudget(24, 6, width=3, top_k=3)
    requests = {slot: Request(prompt, steps=4 - (slot == 2), budget=budget, ahead=ahead)
                for slot, prompt in enumerate(prompts)}

    def make():
        return GGUFMinion(demo_gguf, n_ctx=N_CTX, requests_per_context=per_context)

    expected = {slot: alone(make, r) for slot, r in requests.items()}
    minion = make()
    assert minion.tree_runs == 256 // per_context - 1
    got = batched(minion, requests)
    assert len(minion._contexts) == 1 + 2 // per_context * (per_context == 1)
    assert minion.carries > 0
    for slot in requests:
        assert len(got[slot]) == len(expected[slot]) == requests[slot].steps
        for (tokens, parents, logprobs), (want_tokens, want_parents, want_logprobs) in zip(got[slot], expected[slot]):
            assert (tokens, parents) == (want_tokens, want_parents)
            if per_context == 1:
                assert logprobs == want_logprobs
            else:
                assert logprobs == pytest.approx(want_logprobs, rel=1e-4, abs=1e-4)
    minion.close()


def test_requests_sharing_a_context_interleave_as_alone_and_free_it_together(demo_gguf, prompts):
    """Two requests per context: one request's commits and resets drop only its own
    sequences; a context is freed once neither of its requests holds it."""
    from minions_local.backends.gguf import GGUFMinion

    budget, ahead = GrowBudget(max_nodes=10, max_depth=4, width=3, top_k=3), GrowBudget(24, 6, width=3, top_k=3)
    requests = {slot: Request(prompt, steps=4, budget=budget, ahead=ahead) for slot, prompt in enumerate(prompts)}

    def make():
        return GGUFMinion(demo_gguf, n_ctx=N_CTX, requests_per_context=2)

    expected = {slot: alone(make, r) for slot, r in requests.items()}
    minion = make()
    got = interleaved(minion, requests)
    for slot in requests:
        for (tokens, parents, logprobs), (want_tokens, want_parents, want_logprobs) in zip(got[slot], expected[slot]):
            assert (tokens, parents) == (want_tokens, want_parents)
            assert logprobs == pytest.approx(want_logprobs, rel=1e-4, abs=1e-4)
    assert len(minion._contexts) == 2  # slots 0 and 1 in the first, 2 in the second
    minion.use_slot(0)
    minion.drop_slot(2)
    assert len(minion._contexts) == 1
    minion.drop_slot(1)
    assert len(minion._contexts) == 1  # slot 0 still holds it
    minion.use_slot(3)  # takes the freed block: empty, and slot 0's cache untouched
    assert minion._request.prefix == [] and len(minion._contexts) == 1
    minion.use_slot(0)
    assert minion._request.prefix[:len(prompts[0])] == prompts[0]
    minion.close()


def test_a_batch_reads_its_prompts_in_one_pass_as_each_alone(demo_gguf, prompts):
    """prefill_batch (a batch's prompts, read while the target waits): the requests of
    a shared context read in one pass, and each then grows the tree it grows after a
    prefill of its own; the slot in use stays."""
    from minions_local.backends.gguf import GGUFMinion

    budget = GrowBudget(max_nodes=10, max_depth=4, width=3, top_k=3)
    alone = GGUFMinion(demo_gguf, n_ctx=N_CTX)
    want = {}
    for slot, prompt in enumerate(prompts, start=1):
        alone.use_slot(slot)
        alone.prefill(prompt)
        want[slot] = alone.grow(prompt, budget)
    together = GGUFMinion(demo_gguf, n_ctx=N_CTX)
    together.expect_requests(len(prompts))
    decodes = []
    original = type(together._request.block.context).decode
    try:
        type(together._request.block.context).decode = lambda self, *a: decodes.append(len(a[0])) or original(self, *a)
        together.prefill_batch(list(enumerate(prompts, start=1)))
    finally:
        type(together._request.block.context).decode = original
    assert decodes == [sum(map(len, prompts))] and together.slot == 0
    for slot, prompt in enumerate(prompts, start=1):
        together.use_slot(slot)
        assert together._request.prefix == prompt
        got = together.grow(prompt, budget)
        assert (got.tokens, got.parents) == (want[slot].tokens, want[slot].parents)
        assert got.logprobs == pytest.approx(want[slot].logprobs, rel=1e-4, abs=1e-4)
    alone.close()
    together.close()


def test_a_batch_shares_contexts_only_while_their_cells_stay_few(demo_gguf):
    """One shared KV cache makes every request's attention span every request's cells:
    a batch shares contexts up to SHARED_CELLS tokens between its requests; a server's
    requests (lengths unknown) share up to SHARED_MOST, as llama.cpp's server does."""
    from minions_local.backends.gguf import GGUFMinion

    minion = GGUFMinion(demo_gguf, n_ctx=4096)
    for requests, tokens, shared in [(8, 200, 8), (16, 200, 8), (3, 100, 3), (8, 3000, 2), (8, None, 8), (16, None, 8),
                                     (8, 10**6, 2), (1, 50, 1)]:
        minion.expect_requests(requests, tokens)
        assert minion.requests_per_pass == shared, (requests, tokens)
    minion.close()
