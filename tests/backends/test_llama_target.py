"""The GGUF target on llama.cpp (backends/llama_target.py): every row it verifies, in
trees, batches, chunked prompts, borrowed prefixes and after compaction, has the bits of
the 1-token pass of the same conversation decoded alone from an empty cache."""

from __future__ import annotations

import numpy as np
import pytest

from minions_local.backends.llama_cells import CellLedger
from minions_local.core.protocols import PromptChunk, SlotTree
from minions_local.core.tree import TokenTree

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.gguf

TYPES = {"Q4_1": {}, "Q8_0": {}, "F16": {}, "Q4_K": {"embedding_type": "Q6_K"}}


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer):
    """A tiny Llama as a GGUF in each of several block types (256 wide: K-quant blocks)."""
    from tests.helpers.tiny_gguf import write_gguf
    from tests.helpers.tiny_models import random_model, save, tiny_config

    root = tmp_path_factory.mktemp("llama_target")
    config = tiny_config("llama", hidden=256, layers=2, ctx=2048)
    folder = save(random_model(config, seed=3, scale=4.0), root / "hf", tokenizer)
    return {kind: write_gguf(folder, root / f"{kind}.gguf", kind, **options) for kind, options in TYPES.items()}


def new_target(path, **kwargs):
    from minions_local.backends.llama_target import LlamaTarget

    return LlamaTarget(path, n_ctx=kwargs.pop("n_ctx", 2048), threads=2, **kwargs)


def reference(target, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and each step's logits: the target alone, 1 token a pass, from an empty cache."""
    target.use_slot(0)
    target.reset()
    context = list(prompt)
    target.prefill(context)
    rows = []
    for _ in range(steps):
        tree = TokenTree.from_root(context[-1])
        logits = target.verify(context, tree)[0].numpy().copy()
        target.commit(tree, [0])
        rows.append(logits)
        context.append(int(logits.argmax()))
    return context[len(prompt):], rows


def guess_tree(context: list[int], truth: list[int], done: int, rng, vocab: int) -> TokenTree:
    """A tree below context[-1]: a chain that is mostly the true continuation, with decoys."""
    tree = TokenTree.from_root(context[-1])
    parent = 0
    for d in range(int(rng.integers(0, 6))):
        if done + d >= len(truth):
            break
        for _ in range(int(rng.integers(0, 3))):
            tree.add(parent, int(rng.integers(0, vocab)), score=float(rng.random()))
        token = truth[done + d] if rng.random() < 0.8 else int(rng.integers(0, vocab))
        parent = tree.add(parent, token, score=float(rng.random()))
    return tree


def greedy_path(tree: TokenTree, logits, room: int) -> list[int]:
    path, node = [0], 0
    while len(path) < room:
        child = tree.children[node].get(int(logits[node].argmax()))
        if child is None:
            break
        path.append(child)
        node = child
    return path


def run_requests(target, prompts, steps, rng, *, reads=(7, 100, 1, 33, 10**6), compact_every=0):
    """Decode every prompt greedily with guessed trees, all requests sharing each pass (slot
    i + 1 for prompt i); returns each request's tokens and each verified row's logits."""
    truths = [reference(target, p, steps) for p in prompts]
    target.reset()
    contexts = [list(p) for p in prompts]
    for slot, context in enumerate(contexts, 1):  # prompts read in uneven chunks
        target.use_slot(slot)
        todo, start = target.missing_prompt(context), 0
        for size in reads:
            if todo[start:start + size]:
                target.verify_batch([], [PromptChunk(slot, todo[start:start + size])])
            start += size
    differing, passes = 0, 0
    while any(len(c) - len(p) < steps for c, p in zip(contexts, prompts)):
        items = [SlotTree(slot, c, guess_tree(c, truth[0], len(c) - len(p), rng, target.vocab_size))
                 for slot, (c, p, truth) in enumerate(zip(contexts, prompts, truths), 1) if len(c) - len(p) < steps]
        for item, logits in zip(items, target.verify_batch(items)):
            i = item.slot - 1
            context, done = contexts[i], len(contexts[i]) - len(prompts[i])
            path = greedy_path(item.tree, logits, steps - done)
            differing += sum(not np.array_equal(logits[n].numpy(), truths[i][1][done + k]) for k, n in enumerate(path))
            target.use_slot(item.slot)
            target.commit(item.tree, path)
            context += [item.tree.tokens[n] for n in path[1:]] + [int(logits[path[-1]].argmax())]
        passes += 1
        if compact_every and passes % compact_every == 0:
            target.cache.compact()
    return [c[len(p):len(p) + steps] for c, p in zip(contexts, prompts)], [t[0] for t in truths], differing


@pytest.mark.parametrize("kind,kv_type", [(kind, "q8_0") for kind in sorted(TYPES)] + [("Q4_K", "f16"), ("F16", "f16")])
def test_tree_rows_are_the_bits_of_one_token_passes(files, kind, kv_type):
    """Trees over a prompt read in uneven chunks (up to 512 rows a call over a q8_0 cache, 63
    over a float16 one), past 512 cells (where a lone row over a float16 cache would take
    the split-keys attention kernel): every accepted row's logits equal the 1-token pass's,
    bit for bit, so the tokens do too."""
    target = new_target(files[kind], kv_type=kv_type)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, target.vocab_size, 600)]
    tokens, truth, differing = run_requests(target, [prompt], 40, rng)
    assert differing == 0
    assert tokens == truth
    assert not target.cache.ledger.holes() and target.cache.ledger.in_position_order(target.seq)


def test_requests_sharing_passes_borrowing_a_prefix_and_compacted_stay_exact(files):
    target = new_target(files["Q4_K"], n_ctx=4096)
    rng = np.random.default_rng(1)
    shared = [int(t) for t in rng.integers(3, target.vocab_size, 300)]
    prompts = [shared + [int(t) for t in rng.integers(3, target.vocab_size, n)] for n in (50, 120, 5)]
    tokens, truth, differing = run_requests(target, prompts, 30, rng, compact_every=5)
    assert differing == 0 and tokens == truth
    assert target.cache.compactions > 0
    for slot in (1, 2, 3):
        target.use_slot(slot)
        assert target.cache.ledger.in_position_order(target.seq)
    assert not target.cache.ledger.holes()


def test_trees_beyond_the_free_sequence_ids_verify_in_passes_of_their_own(files):
    """With few sequence ids, the trees that do not fit beside the others verify after
    them, keeping no cell (their accepted tokens are read again): still exact."""
    target = new_target(files["Q4_1"], sequences=24)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, target.vocab_size, 40 + 9 * i)] for i in range(3)]
    tokens, truth, differing = run_requests(target, prompts, 30, rng)
    assert differing == 0 and tokens == truth
    assert not target.cache.ledger.holes()
    assert target.trees_apart > 0


def test_a_later_request_borrows_a_prefix_instead_of_reading_it(files):
    target = new_target(files["Q8_0"])
    rng = np.random.default_rng(2)
    shared = [int(t) for t in rng.integers(3, target.vocab_size, 200)]
    target.use_slot(1)
    target.prefill(shared + [5])
    target.use_slot(2)
    assert target.missing_prompt(shared + [7, 8, 9]) == [7, 8]  # the 200 shared tokens are borrowed
    target.verify_batch([], [PromptChunk(2, [7, 8])])
    tree = TokenTree.from_root(9)
    mine = target.verify(shared + [7, 8, 9], tree)[0].numpy()
    target.commit(tree, [0])
    _, rows = reference(target, shared + [7, 8, 9], 1)
    assert np.array_equal(mine, rows[0])


def test_decoded_entries_serve_the_next_turn(files):
    """A reply's cache entries are what a prompt read of it writes: the next turn reads
    only its new tokens, and its first logits are the empty-cache reference's."""
    target = new_target(files["Q4_1"])
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(3, target.vocab_size, 80)]
    run_requests(target, [prompt], 25, rng)
    target.use_slot(1)
    turn = target.cached + [int(t) for t in rng.integers(3, target.vocab_size, 12)]
    target.forget_beyond(prompt)
    assert len(target.missing_prompt(turn)) < 14
    target.prefill(turn)
    tree = TokenTree.from_root(turn[-1])
    mine = target.verify(turn, tree)[0].numpy()
    target.commit(tree, [0])
    _, rows = reference(target, turn, 1)
    assert np.array_equal(mine, rows[0])


def test_a_hole_below_a_requests_cells_changes_its_rows(files):
    """Why the ledger's rule exists: let llama.cpp put new tokens into cells freed below a
    request's last cell (a tree's rejected branch, freed in place) and the next rows part
    from the reference. The target never does this (it leaves such cells as garbage). (A
    float16 cache shows it in every step; a q8_0 one, which sums in float32, in most.)"""
    target = new_target(files["Q4_1"], kv_type="f16")
    rng = np.random.default_rng(4)
    prompt = [int(t) for t in rng.integers(3, target.vocab_size, 60)]
    truth, rows = reference(target, prompt, 8)
    target.reset()
    target.prefill(prompt)
    tree = TokenTree.from_root(prompt[-1])
    decoy = tree.add(0, (truth[0] + 1) % target.vocab_size, score=1.0)  # laid out first, rejected
    tree.add(decoy, 3, score=1.0)
    accepted = tree.add(0, truth[0], score=0.5)
    target.verify(prompt, tree)
    layout = target._pending.pop(0)
    target.cache.cp(layout.leaf_seq[accepted], target.seq, layout.base, layout.base + 2)  # as a commit of [0, accepted]
    for seq in layout.seqs:  # frees the decoy's cells in place: holes below the accepted token's cell...
        target.lib.llama_memory_seq_rm(target.cache.mem, seq, -1, -1)
        target.cache.ledger.seq_rm(seq)
    target._free_seqs += layout.seqs
    target.cached += [prompt[-1], truth[0]]
    assert target.cache.ledger.holes()
    context = prompt + truth[:2]
    differing = 0
    for k in range(4):  # ...which the next tokens fill, below a cell they come after
        step = TokenTree.from_root(context[-1])
        logits = target.verify(context, step)[0].numpy()
        differing += not np.array_equal(logits, rows[2 + k])
        target.commit(step, [0])
        context.append(truth[2 + k])
    assert differing > 0


def test_rows_differ_passes_on_these_files(files):
    from minions_local.backends.llama_load import rows_differ

    for path in files.values():
        assert rows_differ(new_target(path)) == ""


def test_split_never_leaves_a_lone_row():
    from minions_local.backends.llama_rows import split_calls

    for n in range(1, 300):
        parts = split_calls(n, 63)
        assert [i for p in parts for i in p] == list(range(n))
        assert all(len(p) <= 63 for p in parts)
        assert n == 1 or all(len(p) >= 2 for p in parts)


def test_ledger_mirrors_frees_and_compaction():
    ledger = CellLedger(16)
    ledger.append([0, 1, 2], [{0}, {0}, {0}])
    ledger.append([3, 3, 4], [{5, 6}, {7}, {5}])  # a tree: two branches below the root at 3
    ledger.seq_cp(5, 0, 3, 5)
    assert ledger.seq_rm(5) == [] and ledger.seq_rm(6) == []
    assert ledger.seq_rm(7) == [4]  # the rejected branch's cell is free ...
    assert ledger.holes() == [4]  # ... at cell 4, below the accepted path's cell 5: a hole
    ledger.append([9], [{1}])
    ledger.compacted()
    assert ledger.positions_of(0) == [0, 1, 2, 3, 4] and ledger.cells_of(1) == [5] and not ledger.holes()
    assert ledger.seq_rm(1) == [5]
    ledger.trim()
    assert ledger.top == 5 and ledger.in_position_order(0)


def test_rows_differ_catches_a_kernel_chosen_by_row_count(files):
    # ggml's default takes vec_dot below 8 rows and its tiled kernel above for K-quants:
    # rounding that differs by row count, which the check must see (in a process of its
    # own: ggml reads the switch once).
    import os
    import subprocess
    import sys

    code = ("import sys\nfrom minions_local.backends.llama_load import rows_differ\n"
            "from minions_local.backends.llama_target import LlamaTarget\n"
            "print(repr(rows_differ(LlamaTarget(sys.argv[1], n_ctx=2048, threads=2))))")
    env = {**os.environ, "GGML_CPU_TILED_MM_FORCE": "0"}
    out = subprocess.run([sys.executable, "-c", code, str(files["Q4_K"])], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tree node" in out.stdout.strip().splitlines()[-1]


def test_a_process_that_ran_llama_cpp_first_is_told_why_and_keeps_no_verdict(files, tmp_path):
    # ggml fixes its kernel choice at a process's first matmul: one run by llama_cpp.Llama
    # before minions-local set its switches leaves rows rounding apart. The load must say
    # that (not "re-quantize the file") and cache no verdict that a later process would trust.
    import json
    import os
    import subprocess
    import sys

    code = ("import sys\nfrom pathlib import Path\nfrom llama_cpp import Llama\n"
            "llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, verbose=False)\nllm.eval([1, 2, 3])\n"
            "from minions_local.backends.llama_load import load_llama_target\n"
            "from minions_local.core.errors import ModelLoadError\n"
            "try:\n    load_llama_target(Path(sys.argv[1]), context_tokens=256, threads=2)[0].close()\n"
            "    print('loaded')\n"
            "except ModelLoadError as err:\n    print('refused:', err)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_CPU_TILED")}
    env["MINIONS_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code, str(files["Q4_K"])], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    said = out.stdout.strip().splitlines()[-1]
    # (ggml's stock kernels differ by row count for K-quants on AVX-512 VNNI builds: refused
    # there; a build whose stock kernels happened to agree would load, exact, and pass.)
    assert said == "loaded" or ("imported llama_cpp before" in said and "GGML_CPU_TILED_MM_FORCE=1" in said), said
    checks = tmp_path / "llama-row-checks.json"
    assert not checks.exists() or not any(
        (e if isinstance(e, str) else e.get("verdict")) for e in json.loads(checks.read_text()).values())


def test_the_plan_counts_what_llama_cpp_reports_allocating(files):
    # --plan sizes llama.cpp's buffers before it loads anything; the loaded target's own
    # report (its log) is the truth the estimate must stay near.
    from pathlib import Path

    from minions_local.profile.dims import dims_from_gguf
    from minions_local.profile.gguf_sizes import llama_buffer_bytes, llama_cache_cells

    path = files["Q4_K"]
    for context in (1024, 4096):
        cells = llama_cache_cells(context)
        target = new_target(path, n_ctx=cells)
        reported = target.buffers["output"] + target.buffers["compute"]
        assert llama_buffer_bytes(dims_from_gguf(Path(path)), cells) == pytest.approx(reported, rel=0.1)
        target.close()
