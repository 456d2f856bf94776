"""GGUF export and the llama.cpp minion, checked against the HF models they came from.

Everything is built here: a byte-level BPE tokenizer trained on a few lines, tiny
random Llama / Qwen2 / Mistral checkpoints, their GGUF exports.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from minions_local.core.protocols import CandidateTree, GrowBudget
from minions_local.backends.gguf_export import export_gguf, read_hyperparams, read_vocab
from minions_local.core.errors import ModelLoadError, VocabularyMismatchError
from tests.helpers.tiny_models import noisy_copy, random_model, save, tiny_config

try:
    import llama_cpp  # noqa: F401
    HAS_LLAMA_CPP = True
except ImportError:
    HAS_LLAMA_CPP = False


def needs_llama_cpp(test):
    """Marked `gguf` (select with -m gguf) and skipped where llama-cpp-python is missing."""
    return pytest.mark.gguf(pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")(test))

VOCAB = 320  # model rows; the tokenizer has fewer, so the export must pad
SAMPLE = ("def add(a, b):\n    return a + b  # sum\n\nhello   world, hello minions! "
          "Ünïcödé ✓ 12345 x=[1,2];\t\"quoted\" 'x'\r\nThe quick brown fox.")
CORPUS = ["def add(a, b):\n    return a + b\n", "hello world, hello minions!\n",
          "The quick brown fox jumps over the lazy dog. 0123456789\n", "class Tree:\n    pass\n"] * 25


@pytest.fixture(scope="module")
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<pad>")


def _checkpoint(root, arch: str, tokenizer, seed: int = 0):
    config = tiny_config(arch, vocab=VOCAB)
    if arch == "mistral":
        config.head_dim = 32  # != hidden / heads: GGUF needs explicit key/value lengths
    if arch == "llama":
        config.attention_bias = True  # q/k biases must be permuted like the weights
    if arch == "qwen2":
        config.tie_word_embeddings = True
    model = random_model(config, seed, scale=4.0)
    with torch.no_grad():  # non-zero biases and norms, so a wrong mapping shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return save(model, root / arch, tokenizer), model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, bpe_tokenizer):
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch in ("llama", "qwen2", "mistral"):
        path, model = _checkpoint(root, arch, bpe_tokenizer)
        out[arch] = (path, model, export_gguf(path, root / f"{arch}-f32.gguf", type="f32"))
    return out


def _ids(tokenizer, text=SAMPLE[:60]):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _path(tree: CandidateTree, node: int) -> list[int]:
    """Tokens from the root's child down to `node`."""
    path = []
    while node >= 0:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


def _hf_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()


def assert_valid_tree(tree: CandidateTree, budget: GrowBudget, vocab: int | None) -> None:
    assert 0 < len(tree) <= budget.max_nodes
    assert len(tree.tokens) == len(tree.parents) == len(tree.logprobs)
    assert tree.depth() <= budget.max_depth
    seen = set()
    for i, (token, parent, lp) in enumerate(zip(tree.tokens, tree.parents, tree.logprobs)):
        assert -1 <= parent < i, "parents come before their children"
        assert lp <= 0 and math.isfinite(lp)
        if parent >= 0:
            assert lp <= tree.logprobs[parent] + 1e-9, "path log-probabilities never increase"
        assert (parent, token) not in seen, "no duplicate child"
        seen.add((parent, token))
        if vocab:
            assert 0 <= token < vocab


# --- export (no llama.cpp needed) ----------------------------------------------------

def test_export_metadata_and_vocab(checkpoints, bpe_tokenizer):
    import gguf

    path, model, out = checkpoints["llama"]
    reader = gguf.GGUFReader(out)
    fields = reader.fields
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "llama"
    assert bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode() == "gpt-2"
    tensors = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output.weight", "blk.1.attn_q.bias", "blk.0.ffn_down.weight"} <= tensors
    vocab = read_vocab(path, VOCAB)
    assert len(vocab.tokens) == VOCAB
    assert vocab.tokens[:len(bpe_tokenizer)] == bpe_tokenizer.convert_ids_to_tokens(list(range(len(bpe_tokenizer))))
    assert vocab.token_types[len(bpe_tokenizer)] == 5  # padding rows are unused tokens
    tied = {t.name for t in gguf.GGUFReader(checkpoints["qwen2"][2]).tensors}
    assert "output.weight" not in tied  # tied embeddings: llama.cpp reuses token_embd


def test_export_rejects_unsupported(tmp_path, checkpoints):
    src = checkpoints["llama"][0]
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="cannot be exported"):
        read_hyperparams(tmp_path)
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        export_gguf(tmp_path / "nowhere", tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="unknown GGUF type"):
        export_gguf(src, tmp_path / "x.gguf", type="q3_k")


# --- llama.cpp -----------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@needs_llama_cpp
def test_f32_logits_match_hf(checkpoints, bpe_tokenizer, arch):
    from minions_local.backends.gguf import GGUFMinion

    _, model, out = checkpoints[arch]
    ids = _ids(bpe_tokenizer)
    assert len(ids) >= 8
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    got = GGUFMinion(out, kv_type="f32").logits(ids)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max(axis=-1).max() < 1e-3  # every position


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@needs_llama_cpp
def test_tokenization_identical(checkpoints, bpe_tokenizer, arch):
    import llama_cpp

    llm = llama_cpp.Llama(str(checkpoints[arch][2]), vocab_only=True, verbose=False)
    assert llm.tokenize(SAMPLE.encode(), add_bos=False, special=False) == _ids(bpe_tokenizer, SAMPLE)
    text = "<|endoftext|>hello<|endoftext|> world"
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == _ids(bpe_tokenizer, text)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "f16"])
@needs_llama_cpp
def test_quantized_export_loads_and_runs(checkpoints, bpe_tokenizer, tmp_path, qtype):
    import gguf

    from minions_local.backends.gguf import GGUFMinion

    _, model, f32 = checkpoints["llama"]
    out = export_gguf(checkpoints["llama"][0], tmp_path / f"m-{qtype}.gguf", type=qtype)
    assert out.stat().st_size < f32.stat().st_size
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert qtype.upper() in kinds
    minion = GGUFMinion(out)
    assert minion.vocab_size == VOCAB
    ids = _ids(bpe_tokenizer)
    got = minion.logits(ids)  # several tokens at once: the AMX crash case of a native build
    ref = _hf_logprobs(model, ids)
    assert np.isfinite(got).all()
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    assert agree >= 0.7, f"{qtype} argmax agrees with f32 HF at only {agree:.0%} of positions"
    assert_valid_tree(minion.grow(ids, GrowBudget(16, 4)), GrowBudget(16, 4), VOCAB)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@needs_llama_cpp
def test_grow_is_best_first_tree_of_hf_path_probabilities(checkpoints, bpe_tokenizer, arch):
    """Every node's score is the HF path log-probability: the sequence masks in the
    shared KV cache really are a tree mask."""
    from minions_local.backends.gguf import GGUFMinion

    _, model, out = checkpoints[arch]
    minion = GGUFMinion(out, kv_type="f32")
    context = _ids(bpe_tokenizer)[:10]
    budget = GrowBudget(max_nodes=24, max_depth=4, width=4, top_k=3)
    tree = minion.grow(context, budget)
    assert_valid_tree(tree, budget, VOCAB)
    assert len(tree) == 24 and tree.depth() >= 2
    for node in range(len(tree)):
        path = _path(tree, node)
        lp = _hf_logprobs(model, context + path[:-1])
        expected = sum(lp[len(context) - 1 + d, t] for d, t in enumerate(path))
        assert tree.logprobs[node] == pytest.approx(expected, abs=1e-3)
    # best-first: no node left out scores better than the worst node taken
    # (checked at the root level, where every candidate is known)
    root_lp = _hf_logprobs(model, context)[-1]
    taken = {tree.tokens[i] for i in range(len(tree)) if tree.parents[i] == -1}
    worst = min(tree.logprobs)
    assert all(root_lp[t] <= worst + 1e-4 for t in np.argsort(-root_lp)[:budget.top_k] if t not in taken)


@needs_llama_cpp
def test_a_sampled_grow_draws_its_children_and_its_shape_ignores_the_draws(checkpoints, bpe_tokenizer):
    """When the target samples, the llama.cpp minion draws each node's children from its
    own processed distribution (recorded in `draws`), ranked by draw order: two grows
    with different generators give trees of one shape."""
    from minions_local.backends.gguf import GGUFMinion
    from minions_local.core.sampling import SamplingParams, processed_probs

    _, model, out = checkpoints["llama"]
    minion = GGUFMinion(out, kv_type="f32")
    context = _ids(bpe_tokenizer)[:10]
    sp = SamplingParams(temperature=0.8, top_k=40)
    trees = []
    for seed in (1, 2):
        budget = GrowBudget(max_nodes=12, max_depth=3, width=3, top_k=3, sampling=sp,
                            generator=torch.Generator().manual_seed(seed), vocab_limit=300)
        tree = minion.grow(context, budget)
        assert 0 < len(tree) <= 12 and tree.depth() <= 3 and max(tree.tokens) < 300
        assert -1 in tree.draws and set(tree.draws) <= set(tree.parents)
        for parent, q in tree.draws.items():
            assert q.shape == (300,) and float(q.sum()) == pytest.approx(1.0, abs=1e-4)
            children = [t for t, p in zip(tree.tokens, tree.parents) if p == parent]
            assert len(set(children)) == len(children) and all(q[t] > 0 for t in children)
        root_q = processed_probs(torch.from_numpy(_hf_logprobs(model, context)[-1][:300]).float(), sp)
        assert torch.allclose(tree.draws[-1], root_q, atol=1e-3)  # drawn from the minion's own law
        trees.append(tree)
    assert trees[0].parents == trees[1].parents  # the shape does not depend on what was drawn
    greedy = minion.grow(context, GrowBudget(max_nodes=12, max_depth=3, width=3, top_k=3))
    assert not greedy.draws


@needs_llama_cpp
def test_engine_samples_the_targets_law_with_drawn_gguf_drafts(tmp_path, bpe_tokenizer, monkeypatch):
    """A llama.cpp minion drawing its drafts: the first two tokens still follow the
    target's law (chi-square), and drafts are often accepted."""
    import minions_local.engine.reply as engine_module
    from minions_local import Engine
    from minions_local.core.sampling import SamplingParams, processed_probs
    from tests.helpers.stats import chi2_pvalue, first_two_tokens

    stream = iter(range(10**6))  # unseeded requests draw their drafts: made repeatable here
    monkeypatch.setattr(engine_module.random, "getrandbits", lambda bits: next(stream))
    target = random_model(tiny_config("llama", vocab=VOCAB, layers=2), seed=5, scale=6.0)
    target_dir = save(target, tmp_path / "target", bpe_tokenizer)
    close_dir = save(noisy_copy(target, seed=6, noise=0.05), tmp_path / "close", bpe_tokenizer)
    close_gguf = export_gguf(close_dir, tmp_path / "close-f32.gguf", type="f32")
    engine = Engine.from_pretrained(target_dir, [str(close_gguf)], dtype="float32", budget=6, max_depth=3,
                                    selection="all")
    prompt = _ids(bpe_tokenizer)[:6]
    sp = SamplingParams(0.8, 1.0, 5)
    with torch.no_grad():
        p1 = processed_probs(target(torch.tensor([prompt])).logits[0, -1], sp)
        firsts = [int(x) for x in torch.nonzero(p1).flatten()]
        p2 = processed_probs(target(torch.tensor([prompt + [x] for x in firsts])).logits[:, -1], sp)
    expected = {(x1, int(x2)): float(p1[x1] * p2[i, x2]) for i, x1 in enumerate(firsts)
                for x2 in torch.nonzero(p2[i]).flatten()}
    n = 1200
    seen, drafted = first_two_tokens(engine, prompt, n, temperature=0.8, top_k=5)
    assert drafted > n // 3, "drawn drafts should often serve both tokens in one pass"
    assert chi2_pvalue(seen, expected, n) > 0.001


@needs_llama_cpp
def test_cache_reuse_equals_fresh_run(checkpoints, bpe_tokenizer):
    from minions_local.backends.gguf import GGUFMinion

    out = checkpoints["llama"][2]
    reused, budget = GGUFMinion(out, kv_type="f32", n_ctx=512), GrowBudget(20, 5, width=4, top_k=4)

    def same_as_fresh(context):
        got = reused.grow(context, budget)
        want = GGUFMinion(out, kv_type="f32", n_ctx=512).grow(context, budget)
        assert got.tokens == want.tokens and got.parents == want.parents
        assert np.allclose(got.logprobs, want.logprobs, atol=1e-4)
        return got

    context = _ids(bpe_tokenizer, SAMPLE)[:20]
    tree = same_as_fresh(context)
    deepest = max(range(len(tree)), key=lambda n: len(_path(tree, n)))
    accepted = _path(tree, deepest)[:3] + [7]  # a draft path + a bonus token
    reused.commit(accepted)
    context = context + accepted
    tree = same_as_fresh(context)
    reused.commit([tree.tokens[0], 9])  # accept one draft + bonus
    context = context + [tree.tokens[0], 9]
    same_as_fresh(context)
    same_as_fresh(context)  # the same context twice: the root runs again
    same_as_fresh(context[:9])  # rollback
    same_as_fresh(context[:9] + [3, 4, 5])  # a different continuation (new chat turn)
    same_as_fresh([context[0]])  # only a root
    reused.reset()
    same_as_fresh(context)


@needs_llama_cpp
def test_window_and_sequence_limits(checkpoints, bpe_tokenizer):
    """Near the end of its KV window the minion grows what fits, past it abstains; a
    tree larger than llama.cpp's 256 sequences stops running nodes but stays valid."""
    from minions_local.backends.gguf import GGUFMinion

    out = checkpoints["qwen2"][2]
    ids = _ids(bpe_tokenizer, SAMPLE) * 10
    small = GGUFMinion(out, n_ctx=256)  # llama.cpp's smallest window
    assert small.n_ctx == 256
    budget = GrowBudget(max_nodes=40, max_depth=6, width=8, top_k=4)
    assert_valid_tree(small.grow(ids[:250], budget), budget, VOCAB)  # room to run 6 nodes only
    assert len(small.grow(ids[:260], budget)) == 0
    assert_valid_tree(small.grow(ids[:10], budget), budget, VOCAB)  # and recovers after a rollback
    big = GrowBudget(max_nodes=400, max_depth=12, width=64, top_k=8)
    tree = GGUFMinion(out, n_ctx=1024).grow(ids[:10], big)
    assert_valid_tree(tree, big, VOCAB)
    assert len(tree) == 400
    few = GGUFMinion(out, tree_runs=3).grow(ids[:10], budget)  # 3 runs: a shallow, bushy tree
    assert_valid_tree(few, budget, VOCAB)
    assert few.depth() <= 2


@needs_llama_cpp
def test_vocabulary_check(checkpoints, bpe_tokenizer, tmp_path):
    from minions_local.backends.gguf import GGUFMinion

    minion = GGUFMinion(checkpoints["llama"][2])
    texts = minion.token_texts()
    assert texts[:len(bpe_tokenizer)] == bpe_tokenizer.convert_ids_to_tokens(list(range(len(bpe_tokenizer))))
    minion.check_vocabulary(VOCAB, texts)
    with pytest.raises(VocabularyMismatchError, match="320 token ids"):
        minion.check_vocabulary(VOCAB + 1)
    other = list(texts)
    other[42] = "something else"
    with pytest.raises(VocabularyMismatchError, match="id 42"):
        minion.check_vocabulary(VOCAB, other)
    with pytest.raises(ModelLoadError, match="does not exist"):
        GGUFMinion(tmp_path / "missing.gguf")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="could not load"):
        GGUFMinion(tmp_path / "broken.gguf")


def test_missing_llama_cpp_says_how_to_install(monkeypatch):
    import sys

    from minions_local.backends import llama_context as backend

    monkeypatch.setattr(backend, "_llama", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    with pytest.raises(ModelLoadError, match=r"pip install 'minions-local\[gguf\]'.*GGML_NATIVE=OFF"):
        backend.import_llama_cpp()


def test_export_script(checkpoints, tmp_path, capsys):
    import importlib.util as iu
    from pathlib import Path

    spec = iu.spec_from_file_location("export_gguf_script", Path(__file__).resolve().parents[2] / "scripts" / "export_gguf.py")
    script = iu.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(checkpoints["qwen2"][0]), str(tmp_path / "q.gguf"), "--type", "f32"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["type"] == "f32" and summary["bytes"] == (tmp_path / "q.gguf").stat().st_size
    assert script.main([str(tmp_path / "nowhere"), str(tmp_path / "x.gguf")]) == 1


@needs_llama_cpp
@pytest.mark.parametrize("grow_ahead", [False, True])
def test_engine_greedy_identity_with_gguf_and_ngram(tmp_path, bpe_tokenizer, grow_ahead):
    from minions_local import Engine

    target = random_model(tiny_config("llama", vocab=VOCAB, layers=3), seed=5, scale=25.0)
    target_dir = save(target, tmp_path / "target", bpe_tokenizer)
    close_dir = save(noisy_copy(target, seed=6, noise=0.05), tmp_path / "close", bpe_tokenizer)
    close_gguf = export_gguf(close_dir, tmp_path / "close-q8_0.gguf", type="q8_0")
    engine = Engine.from_pretrained(target_dir, [str(close_gguf), "ngram"], dtype="float32", budget=16, max_depth=6,
                                    grow_ahead=grow_ahead)
    g = torch.Generator().manual_seed(0)
    accepted = []
    for _ in range(4):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        out = engine.generate(prompt, max_new_tokens=30)
        reference = target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=1,
                                    eos_token_id=bpe_tokenizer.eos_token_id)[0, len(prompt):].tolist()
        assert out.token_ids == reference
        accepted += [s.accepted for s in out.steps]
    assert max(accepted) >= 3  # the GGUF minion's drafts really are accepted


@pytest.mark.slow
@needs_llama_cpp
@pytest.mark.parametrize("name", ["minion-llama-s", "minion-qwen2-xs", "minion-mistral-m"])
def test_shipped_demo_minions_export_exactly(tmp_path, name):
    """The demo family stays exportable: same tokens, f32 logits equal, q8_0 argmax close."""
    import inspect

    import llama_cpp
    from transformers import AutoModelForCausalLM

    from minions_local.backends.gguf import GGUFMinion

    src = Path(__file__).resolve().parents[2] / "minions_local" / "demo_models" / name
    if not (src / "config.json").exists():
        pytest.skip("the demo family is not in this checkout")
    # tokenizer.json as saved, which is what the family was trained with. (transformers
    # 5's AutoTokenizer swaps in Qwen2's own pre-tokenizer regex for a qwen2 folder.)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(src / "tokenizer.json"))
    text = inspect.getsource(json.decoder)[:4000]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    f32 = export_gguf(src, tmp_path / "m-f32.gguf", type="f32")
    assert llama_cpp.Llama(str(f32), vocab_only=True, verbose=False).tokenize(
        text.encode(), add_bos=False, special=False) == ids
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids[:48]])).logits[0].numpy()
    assert np.abs(GGUFMinion(f32, kv_type="f32").logits(ids[:48]) - ref).max() < 1e-3
    q8 = GGUFMinion(export_gguf(src, tmp_path / "m-q8_0.gguf", type="q8_0")).logits(ids[:48])
    assert (q8.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


@needs_llama_cpp
def test_a_tree_grown_ahead_carries_into_the_next_step_with_its_cache(checkpoints, bpe_tokenizer):
    """Growing ahead while the target verifies, then committing a path whose bonus token
    landed on a node grown ahead: the next grow starts from that subtree, and every node
    still scores its HF path log-probability from the new context (its KV cells sit at
    the right positions in the right sequences). Other contexts still work after it."""
    from minions_local.backends.gguf import GGUFMinion
    from minions_local.core.protocols import AheadWindow

    _, model, out = checkpoints["llama"]
    minion = GGUFMinion(out, kv_type="f32", n_ctx=512)
    context = _ids(bpe_tokenizer, SAMPLE)[:12]
    budget = GrowBudget(max_nodes=8, max_depth=3, width=4, top_k=3)
    first = minion.grow(context, budget)
    assert minion.grow_ahead(GrowBudget(max_nodes=30, max_depth=6, width=2, top_k=3), AheadWindow()) > 0
    assert len(first) == 8  # the proposal handed out is a copy: growing ahead leaves it alone
    grown = minion._request.tree
    # A node grown ahead (not in the step's tree) that ran and has children of its own.
    ran = [n for n in minion._request.node_seq if n >= len(first) and n in grown.parents]
    assert ran, "growing ahead ran nodes beyond the step's tree"
    accepted = _path(grown, max(ran, key=lambda n: grown.logprobs[n]))  # a draft path, then the bonus
    minion.commit(accepted)
    context = context + accepted
    assert minion._request.prefix == context and len(minion._request.tree) > 0 and minion.carries == 1  # carried
    closing = AheadWindow()
    closing.done.set()
    assert minion.grow_ahead(budget, closing) == 0  # a closed window starts no pass
    tree = minion.grow(context, GrowBudget(max_nodes=12, max_depth=3, width=4, top_k=3))
    assert_valid_tree(tree, GrowBudget(max_nodes=12, max_depth=3), VOCAB)
    for node in range(len(tree)):
        path = _path(tree, node)
        lp = _hf_logprobs(model, context + path[:-1])
        assert tree.logprobs[node] == pytest.approx(sum(lp[len(context) - 1 + d, t] for d, t in enumerate(path)),
                                                    abs=1e-3)
    # A step whose bonus missed everything grown ahead, then a rollback: as fresh.
    minion.grow_ahead(GrowBudget(max_nodes=30, max_depth=6, width=2, top_k=3), AheadWindow())
    minion.commit([tree.tokens[0], 299])
    context = context + [tree.tokens[0], 299]
    for ctx in (context, context[:7]):
        got = minion.grow(ctx, budget)
        want = GGUFMinion(out, kv_type="f32", n_ctx=512).grow(ctx, budget)
        assert got.tokens == want.tokens and got.parents == want.parents
        assert np.allclose(got.logprobs, want.logprobs, atol=1e-4)


def test_a_llama_cpp_build_for_another_cpu_is_refused_with_a_way_out(monkeypatch, tmp_path):
    """A wheel built with AVX-512 would die of an illegal instruction on a CPU without it:
    its stamp is checked against the CPU's flags first."""
    from minions_local.backends import llama_build, llama_context

    stamp = "x86-avx512-avx512vbmi-avx512_vnni-avx512_bf16-avx_vnni-nocommon"
    full = {"avx2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512vbmi", "avx512_vnni",
            "avx512_bf16", "avx_vnni"}
    assert llama_build.missing_extensions(stamp, full) == []
    assert llama_build.missing_extensions(stamp, full - {"avx512bw", "avx_vnni"}) == ["avx512", "avx_vnni"]
    assert llama_build.missing_extensions("portable-nocommon", {"avx2"}) == []
    assert llama_build.missing_extensions("x86-avx512-nocommon-1a2b3c4d", {"avx2"}) == ["avx512"]
    monkeypatch.setattr(llama_context, "_llama", None)
    monkeypatch.setattr(llama_context, "build_problem", lambda: "built for a CPU with avx512, which this CPU lacks")
    with pytest.raises(ModelLoadError, match="avx512.*lacks"):
        llama_context.import_llama_cpp()
