"""bench_batch.py's peers (benchmarks/batch_peers.py) on tiny random stand-ins:
transformers `generate` on a left-padded batch (accelerate disk offload: the tiny
profile is the disk tier) and llama.cpp's batch API on an f32 export, in RAM and in a
memory group. Greedy replies of a batch are each request's reply alone, and our
engine's.

Why exact equality is the right check here: along these replies the stand-in target's
top-2 logit margins are 0.42 or more (measured), far above what float32 batching with
padding (~1e-6) or llama.cpp's f16 KV cache (~1e-3) can move. On a real model a
float32 batch can differ from the request alone at a near-tie (different matmul shapes
and reduction orders), so bench_batch does not claim identity for the peers."""

import json
import os

import numpy as np
import pytest
from benchmarks import batch_peers
from benchmarks.chat_prompts import CHAT_PROMPTS, chat_prompts
from benchmarks.choices import TINY_PROFILE, standin_overrides
from benchmarks.llama_child import LlamaCppBatchServer, MethodFailed, _pick
from benchmarks.memlimit import ROOT

MAX_NEW = 16


def _has(package: str) -> bool:
    return batch_peers._installed(package)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from minions_local import Engine

    workdir = tmp_path_factory.mktemp("batch-peers")
    notes: list[str] = []
    engine = Engine.from_profile(TINY_PROFILE, **standin_overrides(workdir, notes))
    # The stand-in's context is 256 tokens: the prompts that leave room for the reply.
    prompts = [p.ids for p in chat_prompts(engine.tokenizer, len(CHAT_PROMPTS)) if len(p.ids) + MAX_NEW <= 256][:4]
    peers = batch_peers.peer_methods(engine, profile=TINY_PROFILE, max_new=MAX_NEW, most=len(prompts), notes=notes,
                                     workdir=workdir)
    yield engine, prompts, peers, notes, workdir
    for peer in peers:
        if hasattr(peer, "close"):
            peer.close()


def test_every_peer_that_can_run_here_is_built(tiny):
    _, _, peers, notes, _ = tiny
    names = [p.name for p in peers]
    assert "transformers batch" in names  # the tiny profile is the disk tier: accelerate offload
    if _has("llama_cpp"):
        assert "llama.cpp batch" in names
        limited = "llama.cpp batch memlimit" in names
        assert limited or any("llama.cpp batch memlimit skipped" in n for n in notes)
    else:
        assert any("llama.cpp batch skipped" in n for n in notes)


def test_greedy_batch_equals_each_request_alone_and_our_engine(tiny):
    engine, prompts, peers, _, _ = tiny
    ours = [list(engine.generate(ids, max_new_tokens=MAX_NEW, temperature=0.0).token_ids) for ids in prompts]
    for peer in peers:
        batch = [r.tokens for r in peer.run(prompts, MAX_NEW, 0.0, 0).requests]
        alone = [peer.run([ids], MAX_NEW, 0.0, 0).requests[0].tokens for ids in prompts]
        assert batch == alone, peer.name
        assert batch == ours, peer.name


def test_timings_and_stops(tiny):
    engine, prompts, peers, _, _ = tiny
    for peer in peers:
        for temperature in (0.0, 0.7):
            out = peer.run(prompts, MAX_NEW, temperature, 3)
            assert len(out.requests) == len(prompts) and out.steps == []
            for r in out.requests:
                assert 0 < r.first_token <= r.done <= out.wall, peer.name
                assert 1 <= len(r.tokens) <= MAX_NEW
                # A row ends at max_new or at its eos, which it keeps (as our engine does).
                assert len(r.tokens) == MAX_NEW or r.tokens[-1] in engine.eos_ids
                assert not any(t in engine.eos_ids for t in r.tokens[:-1])


def test_sampled_repeats_with_its_seed(tiny):
    _, prompts, peers, _, _ = tiny
    for peer in peers:
        runs = [[r.tokens for r in peer.run(prompts, MAX_NEW, 0.7, seed).requests] for seed in (5, 5, 6)]
        assert runs[0] == runs[1], peer.name
        assert runs[0] != runs[2], peer.name


def test_pick_draws_from_the_tempered_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    assert _pick(logits, 0.0, np.random.default_rng(0)) == 0
    rng = np.random.default_rng(1)
    draws = np.bincount([_pick(logits, 0.7, rng) for _ in range(20000)], minlength=4) / 20000
    tempered = np.exp(logits / 0.7) / np.exp(logits / 0.7).sum()
    assert np.abs(draws - tempered).max() < 0.015  # 3+ standard errors at 20000 draws


def test_missing_packages_or_group_leave_peers_out_with_a_note(tiny, monkeypatch):
    engine, prompts, _, _, workdir = tiny
    monkeypatch.setattr(batch_peers, "_installed", lambda package: False)
    notes: list[str] = []
    assert batch_peers.peer_methods(engine, profile=TINY_PROFILE, max_new=MAX_NEW, most=2, notes=notes,
                                    workdir=workdir) == []
    assert any("transformers batch skipped: accelerate" in n for n in notes)
    assert any("llama.cpp batch skipped: llama-cpp-python" in n for n in notes)
    if not _has("llama_cpp"):
        return
    monkeypatch.setattr(batch_peers, "_installed", lambda package: package == "llama_cpp")
    monkeypatch.setattr(batch_peers, "_no_memory_group", lambda: "no cgroup v1 memory controller (test)")
    notes = []
    peers = batch_peers.peer_methods(engine, profile=TINY_PROFILE, max_new=MAX_NEW, most=2, notes=notes,
                                     workdir=workdir)
    try:
        assert [p.name for p in peers] == ["llama.cpp batch"]
        assert any("llama.cpp batch memlimit skipped: no cgroup" in n for n in notes)
    finally:
        for p in peers:
            p.close()


@pytest.mark.skipif(not _has("llama_cpp"), reason="needs llama-cpp-python")
def test_a_dead_child_fails_the_run_not_the_benchmark(tiny):
    _, prompts, _, notes, workdir = tiny
    server = LlamaCppBatchServer(workdir / "target-f32.gguf", threads=1, sequences=2, n_ctx=256, warm_ids=prompts[0],
                                 memory_share=None, tag="test-dead", notes=notes)
    try:
        server.child.kill()
        with pytest.raises(MethodFailed):
            server.run_batch(prompts[:2], 4, 0.0, 0, [0])
    finally:
        server.close(notes)


class _FailingPeer:
    """A peer whose llama.cpp child dies after the warm-up."""

    name = "failing peer"

    def run(self, prompts, max_new, temperature, seed):
        if max_new == 4:  # bench_batch's warm-up
            return batch_peers.BatchResult([batch_peers.RequestTiming([1], 0.1, 0.1)], 0.1)
        raise MethodFailed("the child died (test)")


def test_bench_batch_tiny_with_peers(tmp_path, capsys, monkeypatch):
    import bench_batch

    real = batch_peers.peer_methods
    monkeypatch.setattr(batch_peers, "peer_methods", lambda *a, **k: [*real(*a, **k), _FailingPeer()])
    mine = f"minions-bench-{os.getpid()}-batch*"
    before = set(ROOT.glob(mine)) if ROOT.is_dir() else set()  # (the module fixture's peers hold theirs)
    assert bench_batch.main(["--tiny", "--modes", "greedy,sampled", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    rows = result["results"]
    names = ["transformers batch"] + (["llama.cpp batch"] if _has("llama_cpp") else [])
    for name in names:
        for n in (1, 2):
            for mode in ("greedy", "sampled"):
                row = rows[f"{name}/{n}/{mode}"]
                assert row["aggregate_tok_s"] > 0 and row["median_ttft_s"] > 0, (name, n, mode)
                assert row["tokens_per_pass"] is None
                if name == "transformers batch" and mode == "greedy":  # same model, same math as ours
                    assert row["identical_to_alone"] == n
                else:
                    assert row["identical_to_alone"] is None
    assert not any(key.startswith("failing peer/") for key in rows)  # its runs failed: left out, the rest ran
    if "llama.cpp batch memlimit/1/greedy" in rows:  # the limited child reads its weights from disk
        assert "llama.cpp batch memlimit: " in out and "MB read from disk per llama_decode" in out
    assert "note: failing peer N=1 greedy failed: the child died (test)" in out
    if ROOT.is_dir():  # the peers' memory groups are gone once the benchmark returns
        assert set(ROOT.glob(mine)) == before
