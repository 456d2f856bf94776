"""A target's model loaded by llama.cpp from the moment its path is known (backends/
llama_early.py): the load takes that model and computes the same bits; one it does not
take is freed; a file llama.cpp refuses early says nothing then and is named by the load.
And what lets two loads run at once: log lines kept per thread, and load switches that
loads asking the same share (backends/llama_context.py)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from minions_local.core.errors import ModelLoadError
from minions_local.core.tree import TokenTree

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.gguf

PROMPT = [1, 5, 9, 14, 20, 31, 7, 2]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    from tests.helpers.tiny_gguf import write_gguf
    from tests.helpers.tiny_models import random_model, save, tiny_config

    root = tmp_path_factory.mktemp("early")
    config = tiny_config("llama", hidden=256, layers=4, ctx=1024)
    folder = save(random_model(config, seed=11, scale=4.0), root / "hf", tokenizer)
    return write_gguf(folder, root / "model.gguf", "Q4_K", embedding_type="Q6_K", types={"blk.1.ffn_down.weight": "Q6_K"})


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    from minions_local.backends import llama_early

    monkeypatch.setenv("MINIONS_CACHE_DIR", str(tmp_path / "cache"))  # a new file: its cut is checked too
    llama_early.drop_early_models()
    yield
    llama_early.drop_early_models()


def _logits(target) -> np.ndarray:
    target.use_slot(0)
    target.reset()
    target.prefill(PROMPT)
    tree = TokenTree.from_root(PROMPT[-1])
    for i in range(6):
        tree.add(i // 2, 3 + i, score=1.0)
    return target.verify(PROMPT, tree).numpy().copy()


def test_the_load_takes_the_model_loaded_early_and_computes_the_same_bits(model, monkeypatch):
    from minions_local.backends import llama_early
    from minions_local.backends.llama_load import load_llama_target
    from minions_local.planning.target_read_ahead import read_target_ahead

    plain, _ = load_llama_target(model, context_tokens=256, threads=2)
    try:
        want = _logits(plain)
    finally:
        plain.close()
    assert read_target_ahead(model, on_llama_cpp=True)
    (early,) = llama_early._loads.values()
    assert early.done.wait(60) and early.model
    loads = []
    real = llama_cpp.llama_model_load_from_file
    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", lambda path, params: loads.append(path) or
                        real(path, params))
    target, _ = load_llama_target(model, context_tokens=256, threads=2)
    try:
        assert not llama_early._loads
        assert target.model == early.model  # the early load's own model, not a second load
        assert not [p for p in loads if p.endswith(b"model.gguf")], loads  # (the cut's load is the only one)
        assert np.array_equal(_logits(target), want)
    finally:
        target.close()


def test_a_model_the_load_does_not_take_is_freed(model):
    """The plan streamed the target after all: its model loaded for RAM goes before the
    streamed one is mapped; and one nobody claims goes when the engine's load ends."""
    from minions_local.backends import llama_early
    from minions_local.backends.llama_load import load_llama_target

    llama_early.load_model_early(model)
    (early,) = llama_early._loads.values()
    tiers = ["device", "disk", "disk", "device"]
    target, _ = load_llama_target(model, context_tokens=256, threads=2, layer_tiers=tiers, window=1)
    try:
        assert not llama_early._loads and early.model is None  # freed
        assert target.streamer is not None and target.model
    finally:
        target.close()
    llama_early.load_model_early(model)
    (early,) = llama_early._loads.values()
    llama_early.drop_early_models()
    assert not llama_early._loads and early.model is None
    # asked with other settings than it was loaded with, it is freed and not given
    llama_early.load_model_early(model)
    (early,) = llama_early._loads.values()
    assert llama_early.claim_early_model(model, n_gpu_layers=0, interleave=False, prefetch=True) is None
    assert early.model is None


def test_a_file_llama_cpp_refuses_early_is_named_by_the_load_alone(tmp_path, model, capfd):
    """An architecture llama.cpp does not know: the early load fails without a line on
    stderr, and the load then names the file and what to do, as without it."""
    from minions_local.backends import llama_early
    from minions_local.backends.llama_load import load_llama_target
    from tests.helpers.tiny_gguf import write_gguf

    foreign = write_gguf(model.parent / "hf", tmp_path / "foreign.gguf", "Q8_0", architecture="foo")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    for path in (foreign, truncated):
        llama_early.load_model_early(path)
    for early in list(llama_early._loads.values()):
        assert early.done.wait(60) and early.model is None
    assert capfd.readouterr().err == ""
    with pytest.raises(ModelLoadError, match="its architecture 'foo' is not one this llama.cpp knows"):
        load_llama_target(foreign, context_tokens=256)
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        load_llama_target(truncated, context_tokens=256)
    assert capfd.readouterr().err == ""  # the message says it all, without llama.cpp's lines
    assert all(early.model is None for early in llama_early._loads.values())


def test_each_thread_s_log_lines_are_its_own(capfd):
    """Lines logged on a thread in a block of its own go to that block alone; a thread in
    none (a ggml worker) logs to every block; held errors stay with their thread's block:
    dropped where it fails, written where it ends well."""
    from minions_local.backends import llama_context

    llama_context.import_llama_cpp()
    log = llama_context._log_callback
    inside, logged = threading.Barrier(2, timeout=10), threading.Barrier(3, timeout=10)
    go = {"a": threading.Event(), "b": threading.Event()}
    seen: dict[str, list[str]] = {}

    def load(name: str) -> None:
        try:
            with llama_context.log_lines(hold_errors=True) as lines:
                seen[name] = lines
                inside.wait()
                log(2, f"{name} info\n".encode(), None)
                log(4, f"{name} error\n".encode(), None)
                logged.wait()
                go[name].wait(10)
                if name == "a":
                    raise RuntimeError  # a failed load: its errors go with it
        except RuntimeError:
            pass

    threads = [threading.Thread(target=load, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    logged.wait()
    log(2, b"worker\n", None)
    go["b"].set()  # b ends well while a still holds its errors: b's are not a's to drop
    threads[1].join(10)
    go["a"].set()
    threads[0].join(10)
    assert seen == {"a": ["a info\n", "a error\n", "worker\n"], "b": ["b info\n", "b error\n", "worker\n"]}
    err = capfd.readouterr().err
    assert "b error" in err and "a error" not in err


def test_loads_with_the_same_switches_share_them_and_others_wait():
    from minions_local.backends.llama_context import load_switches

    assert "GGML_CPU_TILED_REPACK" not in os.environ
    order: list[str] = []
    both_in, inside = threading.Barrier(2, timeout=10), threading.Event()

    def interleaved(name: str) -> None:
        with load_switches(repack=True):
            both_in.wait()  # would time out if the second waited for the first
            order.append(f"{name} {os.environ.get('GGML_CPU_TILED_REPACK')} {os.environ.get('LLAMA_MMAP_PREFETCH')}")
            inside.set()
            time.sleep(0.3)

    def streamed() -> None:
        inside.wait(10)
        with load_switches(prefetch=False):
            order.append(f"streamed {os.environ.get('GGML_CPU_TILED_REPACK')} {os.environ.get('LLAMA_MMAP_PREFETCH')}")

    threads = [threading.Thread(target=interleaved, args=(n,)) for n in ("a", "b")] + [threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(order[:2]) == ["a 1 None", "b 1 None"] and order[2] == "streamed None 0"
    assert "GGML_CPU_TILED_REPACK" not in os.environ and "LLAMA_MMAP_PREFETCH" not in os.environ
