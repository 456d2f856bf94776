"""A target's model loaded by llama.cpp from the moment its path is known, and its named
GGUF minions made (backends/llama_early.py): the load takes that model and computes the
same bits, the minion's load takes that minion; what is not taken is freed; a file
llama.cpp refuses early says nothing then and is named by the load.
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


def test_the_load_takes_the_model_loaded_early_and_computes_the_same_bits(model, monkeypatch, tmp_path):
    from minions_local.backends import llama_early
    from minions_local.backends.llama_load import load_llama_target
    from minions_local.planning.target_read_ahead import read_target_ahead

    plain, _ = load_llama_target(model, context_tokens=256, threads=2)
    try:
        want = _logits(plain)
        plain._special = None
        special = plain.special_ids()  # asked of the model itself
    finally:
        plain.close()
    monkeypatch.setenv("MINIONS_CACHE_DIR", str(tmp_path / "new-cache"))  # the file checked on its cut again
    assert read_target_ahead(model, on_llama_cpp=True)
    (early,) = llama_early._loads.values()
    assert early.done.wait(60) and early.made
    loads = []
    real = llama_cpp.llama_model_load_from_file
    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", lambda path, params: loads.append(path) or
                        real(path, params))
    target, _ = load_llama_target(model, context_tokens=256, threads=2)
    try:
        assert not llama_early._loads
        assert target.model == early.made  # the early load's own model, not a second load
        assert not [p for p in loads if p.endswith(b"model.gguf")], loads  # (the cut's load is the only one)
        assert np.array_equal(_logits(target), want)
        assert target._special is not None and target.special_ids() == special  # the cut's answer
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
        assert not llama_early._loads and early.made is None  # freed
        assert target.streamer is not None and target.model
    finally:
        target.close()
    llama_early.load_model_early(model)
    (early,) = llama_early._loads.values()
    llama_early.drop_early_models()
    assert not llama_early._loads and early.made is None
    # asked with other settings than it was loaded with, it is freed and not given
    llama_early.load_model_early(model)
    (early,) = llama_early._loads.values()
    assert llama_early.claim_early_model(model, n_gpu_layers=0, interleave=False, prefetch=True) is None
    assert early.made is None


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
        llama_early.build_minion_early(path)
    for early in list(llama_early._loads.values()):
        assert early.done.wait(60) and early.made is None
    assert capfd.readouterr().err == ""
    from minions_local.backends.gguf import GGUFMinion

    for path in (foreign, truncated):
        with pytest.raises(ModelLoadError, match=path.name):
            GGUFMinion.from_path(path)
    capfd.readouterr()
    with pytest.raises(ModelLoadError, match="its architecture 'foo' is not one this llama.cpp knows"):
        load_llama_target(foreign, context_tokens=256)
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        load_llama_target(truncated, context_tokens=256)
    assert capfd.readouterr().err == ""  # the message says it all, without llama.cpp's lines
    assert all(early.made is None for early in llama_early._loads.values())


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

    def minion() -> None:  # no switches: it waits too (its weights take ggml's own layouts)
        inside.wait(10)
        with load_switches():
            order.append(f"minion {os.environ.get('GGML_CPU_TILED_REPACK')} {os.environ.get('LLAMA_MMAP_PREFETCH')}")

    threads = [threading.Thread(target=interleaved, args=(n,)) for n in ("a", "b")] + \
        [threading.Thread(target=streamed), threading.Thread(target=minion)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(order[:2]) == ["a 1 None", "b 1 None"] and sorted(order[2:]) == ["minion None None",
                                                                                     "streamed None 0"]
    assert "GGML_CPU_TILED_REPACK" not in os.environ and "LLAMA_MMAP_PREFETCH" not in os.environ


def _drafted(minion, context: list[int]) -> list[int]:
    from minions_local.core.protocols import GrowBudget

    minion.reset()
    minion.prefill(context)
    tree = minion.grow(context, GrowBudget(max_nodes=8, max_depth=3, top_k=2))
    minion.reset()
    return list(tree.tokens)


def test_a_named_gguf_minion_is_made_while_the_target_loads_and_taken_by_its_load(model, monkeypatch):
    """Where the target's model loads early, the GGUF minions the profile names are made
    early too (its model and first context, on a thread of their own); the minion's load
    takes that one, which drafts as one made then does; one asked with other options is
    closed and made anew; with minions the plan will choose (a command-line target, no
    minion named) nothing is made early."""
    from minions_local.backends import llama_early, llama_stream
    from minions_local.backends.gguf import GGUFMinion
    from minions_local.planning import target_read_ahead
    from minions_local.planning.machine_memory import MachineMemory

    monkeypatch.setattr(target_read_ahead, "usable_memory",
                        lambda: MachineMemory(100 * model.stat().st_size, "test", 0))
    assert target_read_ahead.read_named_profile_target_ahead("cpu-demo", target=str(model))
    llama_stream.claim_read_ahead([model]).stop()
    assert [kind for kind, _ in llama_early._loads] == ["target"]  # the plan picks the minions
    llama_early.drop_early_models()

    # the same file as target and minion: two loads of their own
    assert target_read_ahead.read_named_profile_target_ahead("cpu-demo", target=str(model),
                                                             minions=[str(model), "ngram"])
    llama_stream.claim_read_ahead([model]).stop()
    assert sorted(kind for kind, _ in llama_early._loads) == ["minion", "target"]
    early = llama_early._loads[("minion", str(model.resolve()))]
    assert early.done.wait(60) and early.made is not None
    made_early = early.made
    minion = GGUFMinion.from_path(model, n_gpu_layers=0)
    assert minion is made_early and ("minion", str(model.resolve())) not in llama_early._loads
    fresh = GGUFMinion(model)
    try:
        assert _drafted(minion, PROMPT) == _drafted(fresh, PROMPT)
    finally:
        fresh.close()
        minion.close()

    llama_early.build_minion_early(model)
    (again,) = [load for (kind, _), load in llama_early._loads.items() if kind == "minion"]
    assert again.done.wait(60) and again.made is not None
    other = GGUFMinion.from_path(model, n_ctx=512)
    try:
        assert other is not again.made and again.made is None  # made anew; the early one closed
    finally:
        other.close()


def test_a_load_lets_go_of_its_switches_once_llama_cpp_has_made_its_weights_buffers():
    """load_model_file holds the switches while llama.cpp maps the file and chooses each
    weight's buffer, and lets go at its "model buffer size" line: a minion's load (no
    switches, which waits for others) goes on while the weights are read and copied."""
    from minions_local.backends import llama_context

    llama_context.import_llama_cpp()  # its log callback is installed
    seen: list[tuple[list, str | None]] = []

    def state() -> tuple[list, str | None]:
        return [dict(h) for h in llama_context._switch_holders], os.environ.get("GGML_CPU_TILED_REPACK")

    class Lib:
        @staticmethod
        def llama_model_load_from_file(path: bytes, params) -> int:
            seen.append(state())
            llama_context._log_callback(2, b"load_tensors: CPU_Mapped model buffer size = 1.00 MiB\n", None)
            seen.append(state())
            return 7

    assert llama_context.load_model_file(Lib(), "x.gguf", None, interleave=True) == 7
    assert seen == [([{"GGML_CPU_TILED_REPACK": "1"}], "1"), ([], None)]
    assert state() == ([], None) and not llama_context._line_watchers
