"""The cut a new GGUF's exactness check runs on (backends/llama_check_model.py): the
fewest layers holding every kind of layer tensor, as a model llama.cpp loads; the load
checks it instead of the whole model, keeps its timed shape, and falls back to the whole
model where llama.cpp refuses the cut."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.gguf

# Layer 1's ffn_down and layer 2's attn_v differ from the other layers' (as Q4_K_M mixes Q6_K in).
MIXED = {"blk.1.ffn_down.weight": "Q6_K", "blk.2.attn_v.weight": "Q8_0"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer):
    from tests.helpers.tiny_models import random_model, save, tiny_config

    config = tiny_config("llama", hidden=256, layers=4, ctx=2048)
    return save(random_model(config, seed=5, scale=4.0), tmp_path_factory.mktemp("cut") / "hf", tokenizer)


@pytest.fixture(scope="module")
def mixed(folder, tmp_path_factory):
    from tests.helpers.tiny_gguf import write_gguf

    return write_gguf(folder, tmp_path_factory.mktemp("cut") / "mixed.gguf", "Q4_K", embedding_type="Q6_K",
                      types=MIXED)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIONS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_cut_holds_every_kind_of_layer_tensor_and_loads(mixed, tmp_path):
    from minions_local.backends.llama_check_model import covering_layers, write_cut_model
    from minions_local.backends.llama_load import rows_differ
    from minions_local.backends.llama_target import LlamaTarget
    from minions_local.models.gguf_file import read_model

    model = read_model(mixed)
    assert covering_layers(model) == [0, 1, 2]  # layer 3 holds nothing layer 0 does not
    path = tmp_path / "cut.gguf"
    with open(path, "w+b") as out:
        size = write_cut_model(model, [1, 2], out)
    cut = read_model(path)
    assert size == path.stat().st_size
    assert cut.arch_value("block_count") == 2
    assert {k: v for k, v in cut.metadata.items() if k != "llama.block_count"} == \
        {k: v for k, v in model.metadata.items() if k != "llama.block_count"}
    assert cut.tensors["blk.0.ffn_down.weight"].type_name == "Q6_K"  # layer 1, renumbered
    assert cut.tensors["blk.1.attn_v.weight"].type_name == "Q8_0"
    assert not any(n.startswith("blk.2.") for n in cut.tensors)
    raw = lambda m, name: np.fromfile(m.path, np.uint8, m.tensors[name].nbytes,  # noqa: E731
                                      offset=m.tensors[name].offset)
    assert np.array_equal(raw(cut, "blk.1.ffn_gate.weight"), raw(model, "blk.2.ffn_gate.weight"))
    assert np.array_equal(raw(cut, "token_embd.weight"), raw(model, "token_embd.weight"))
    target = LlamaTarget(path, n_ctx=2048, threads=2)
    assert target.vocab_size == model.metadata["tokenizer.ggml.tokens"].__len__()
    assert rows_differ(target) == ""
    target.close()


def test_the_cut_of_a_split_model_is_one_file(folder, tmp_path):
    from minions_local.backends.llama_check_model import covering_layers, cut_model_path
    from minions_local.backends.llama_target import LlamaTarget
    from minions_local.models.gguf_file import SPLIT_COUNT, read_model
    from tests.helpers.tiny_gguf import write_gguf

    first = write_gguf(folder, tmp_path / "split.gguf", "Q4_K", embedding_type="Q6_K", types=MIXED, shard_tensors=12)
    model = read_model(first)
    assert len(model.files) > 1
    with cut_model_path(model, covering_layers(model)) as path:
        cut = read_model(path)
        assert SPLIT_COUNT not in cut.metadata and len(cut.files) == 1
        LlamaTarget(path, n_ctx=1024, threads=2).close()


def test_a_new_file_is_checked_on_its_cut_and_keeps_its_timed_shape(mixed, cache, monkeypatch):
    from minions_local.backends import llama_check_model
    from minions_local.backends.llama_load import load_llama_target

    from minions_local.speculation.calibration import time_pass_shape

    target, _ = load_llama_target(mixed, context_tokens=512, threads=2, time_shape=time_pass_shape)
    assert target.first_passes == []  # not one pass of the whole model at load
    assert [n for n, _ in target.pass_shape] == [0, 4, 24] and all(t > 0 for _, t in target.pass_shape)
    shape = target.pass_shape
    target.close()

    @contextlib.contextmanager
    def no_cut(*_):
        raise AssertionError("a file checked before is not cut again")
        yield

    monkeypatch.setattr(llama_check_model, "cut_model_path", no_cut)
    again, _ = load_llama_target(mixed, context_tokens=512, threads=2, time_shape=time_pass_shape)
    assert again.pass_shape == shape and again.first_passes == []
    again.close()


def test_the_cut_s_passes_are_scaled_by_the_bytes_a_pass_reads(mixed, cache):
    """A pass reads every matrix but the embedding (a tied one is the head: read whole);
    the cut's times, scaled by the model's bytes over the cut's, are the model's own, and
    they agree with the model's passes."""
    from minions_local.backends import llama_load
    from minions_local.backends.llama_check_model import covering_layers, pass_bytes_ratio
    from minions_local.models.gguf_file import read_model
    from minions_local.speculation.calibration import time_pass_shape, time_verify_passes

    model = read_model(mixed)
    tied = "output.weight" not in model.tensors
    read = {n: t.nbytes for n, t in model.tensors.items()
            if len(t.shape) >= 2 and (n != "token_embd.weight" or tied)}
    layer3 = sum(b for n, b in read.items() if n.startswith("blk.3."))
    assert pass_bytes_ratio(model, covering_layers(model)) == pytest.approx(sum(read.values()) /
                                                                           (sum(read.values()) - layer3))
    assert pass_bytes_ratio(model, [0]) > pass_bytes_ratio(model, [0, 1, 2]) > 1.0
    target, _ = llama_load.load_llama_target(mixed, context_tokens=512, threads=2, time_shape=time_pass_shape)
    entry = llama_load._cached_entry([mixed], llama_load.INTERLEAVED)  # held in RAM
    scale = pass_bytes_ratio(model, covering_layers(model))
    assert target.pass_shape == [(n, t * scale) for n, t in entry["shape"]]
    # The estimate is the cut's least pass of each size (calibration.time_pass_shape), the
    # model's own here the least of three rounds of five. A pass reading bytes costs the
    # scale the bytes set; a tiny model's are launch-bound, between a fixed cost (the head,
    # the graph: the estimate is then `scale` times the model's own) and one per layer (its
    # cut runs len(layers) of the model's 4: scale * len(layers) / 4 of it). Twice either
    # way for the noise: on a shared 2-core box (AVX-512 EPYC) the least of five
    # sub-millisecond passes moved by 1.5x from one second to the next, the cut's (timed at
    # load) against the model's (timed here). What this catches is a shape off by its scale
    # or taken from another pass than the cut's least (a whole-model pass, a first one).
    layers = covering_layers(model)
    low, high = min(1.0, scale * len(layers) / 4), max(1.0, scale)
    rounds = [time_verify_passes(target, target.vocab_size, (0, 24), warm_up=False, first_untimed=True, repeats=5)
              for _ in range(3)]
    for k, (nodes, estimate) in enumerate(target.pass_shape[::2]):
        own = min(r[k][1] for r in rounds)
        assert own * low / 2 <= estimate <= own * high * 2, (nodes, estimate, own, low, high)
    target.close()


def test_a_streamed_model_s_shape_is_one_pass_of_its_own_plus_the_cut_s_growth(mixed, cache):
    """Streamed, the model's reads are timed by one 1-token pass of its own (no cut in
    memory can say them); each size then costs that plus what its rows add in the cut's
    shape. One pass of the model, not the cost model's three."""
    from minions_local.backends import llama_load
    from minions_local.backends.llama_check_model import covering_layers, pass_bytes_ratio
    from minions_local.models.gguf_file import read_model
    from minions_local.speculation.calibration import time_lone_pass, time_pass_shape

    lone = []

    def timed_lone(target):
        lone.append(time_lone_pass(target))
        return lone[-1]

    tiers = ["device", "disk", "device", "disk"]
    target, _ = llama_load.load_llama_target(mixed, context_tokens=512, threads=2, layer_tiers=tiers,
                                             time_shape=time_pass_shape, time_lone=timed_lone)
    try:
        assert len(lone) == 1 and len(target.first_passes) == 1 and target.first_passes[0][0] == 0
        entry = llama_load._cached_entry([mixed])  # the streamed layout's
        scale = pass_bytes_ratio(read_model(mixed), covering_layers(read_model(mixed)))
        cut = [(n, t * scale) for n, t in entry["shape"]]
        assert [n for n, _ in target.pass_shape] == [0, 4, 24]
        assert target.pass_shape == [(n, lone[0] + t - cut[0][1]) for n, t in cut]
    finally:
        target.close()
    # Without a lone pass's timing (a caller that times nothing) the model's passes are
    # the cost model's to time, as before.
    again, _ = llama_load.load_llama_target(mixed, context_tokens=512, threads=2, layer_tiers=tiers)
    assert again.pass_shape == [] and again.first_passes == []
    again.close()


def test_a_cut_llama_cpp_refuses_means_the_whole_model_is_checked(mixed, cache, monkeypatch, tmp_path):
    from minions_local.backends import llama_check_model
    from minions_local.backends.llama_load import load_llama_target

    refused = tmp_path / "refused.gguf"
    refused.write_bytes(mixed.read_bytes()[:4096])  # what llama.cpp says of a cut it cannot load

    @contextlib.contextmanager
    def bad_cut(*_):
        yield refused

    monkeypatch.setattr(llama_check_model, "cut_model_path", bad_cut)
    target, _ = load_llama_target(mixed, context_tokens=512, threads=2)
    assert len(target.first_passes) == 6 and target.pass_shape == []  # the check's passes, on the model itself
    target.close()


def test_the_cut_catches_a_kernel_chosen_by_row_count(mixed):
    # As test_llama_target's test of the whole model: ggml's default takes vec_dot below 8
    # rows and its tiled kernel above for K-quants; the cut runs those kernels too.
    code = ("import sys\nfrom minions_local.backends.llama_load import _check_cut\n"
            "from minions_local.models.gguf_file import read_model\n"
            "print(repr(_check_cut(read_model(sys.argv[1]), 2048, 2, None)[0]['verdict']))")  # no shape timed
    env = {**os.environ, "GGML_CPU_TILED_MM_FORCE": "0"}
    out = subprocess.run([sys.executable, "-c", code, str(mixed)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tree node" in out.stdout.strip().splitlines()[-1]
