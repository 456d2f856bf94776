"""A streamed llama.cpp target's load (backends/llama_load.py, llama_stream.py): llama.cpp
maps the file without reading it (our patch's LLAMA_MMAP_PREFETCH=0), and what stays
resident is read from the start of the load; the streamed layers are left to the
streamer, which reads only its window ahead of the first pass."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.llama_child import drop_page_cache
from minions_local.core.tree import TokenTree
from tests.helpers.offload_helpers import cached_pages, device_readahead_bytes

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    """A tiny Llama of 8 layers of ~1.3 MB (Q4_K): wider than a fault's readahead."""
    from tests.helpers.tiny_gguf import write_gguf
    from tests.helpers.tiny_models import random_model, save, tiny_config

    root = tmp_path_factory.mktemp("stream")
    config = tiny_config("llama", hidden=512, layers=8, ctx=1024)
    folder = save(random_model(config, seed=3, scale=4.0), root / "hf", tokenizer)
    return write_gguf(folder, root / "model.gguf", "Q4_K", embedding_type="Q6_K")


def test_resident_spans_are_the_kept_layers_and_everything_outside_the_layers(model):
    from minions_local.backends.llama_stream import layer_spans, resident_spans
    from minions_local.models.gguf_file import read_model

    files = read_model(model).files
    spans = layer_spans(files, 8)
    whole = resident_spans(files, spans, set(range(8)))
    covered = sorted((s.start, s.end) for s in whole)
    assert covered[0][0] == 0 and covered[-1][1] == files[0].size
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # no gap, no overlap
    kept = resident_spans(files, spans, {2})
    outside = [s for s in kept if s not in spans[2]]
    assert [s for s in kept if s in spans[2]] == spans[2]
    assert sum(s.size for s in outside) == files[0].size - sum(s.size for parts in spans for s in parts)


@pytest.mark.parametrize("splice", [True, False], ids=["sendfile", "plain reads"])
def test_the_loads_read_ahead_caches_every_byte_it_is_given(model, monkeypatch, splice):
    """FileReadAhead leaves every page of its ranges in the page cache: a range of several
    chunks and a part of one, with neither end on a page boundary; spliced to /dev/null,
    or read where the kernel refuses the splice."""
    import errno
    import os

    from minions_local.backends import llama_stream
    from minions_local.backends.llama_stream import FileReadAhead, Span

    spliced = []
    real = os.sendfile

    def sendfile(*args):
        if not splice:
            raise OSError(errno.EINVAL, "no splice from this file system")
        spliced.append(args[-1])
        return real(*args)

    monkeypatch.setattr(os, "sendfile", sendfile)
    monkeypatch.setattr(FileReadAhead, "CHUNK", 1 << 20)  # the test model is ~10 MB
    size = model.stat().st_size
    part, whole = Span(0, size // 3 + 1, size - 5), Span(0, 0, size)  # (a whole file is spliced)
    assert part.size > 2.5 * FileReadAhead.CHUNK
    for span in (part, whole):
        drop_page_cache(model)
        spliced.clear()
        ahead = FileReadAhead([model], [span])
        assert ahead.wait(60)
        ahead.stop()
        cached, pages = cached_pages(model, span.start - span.start % llama_stream.PAGE, span.end)
        assert cached == pages, (span, cached, pages)
        assert sum(spliced) == (size if splice and span is whole else 0)


def test_a_streamed_load_reads_the_resident_layers_and_not_the_streamed_ones(model, tmp_path, monkeypatch):
    from minions_local.backends.llama_load import load_llama_target

    monkeypatch.setenv("MINIONS_CACHE_DIR", str(tmp_path / "cache"))  # a new file: its cut is checked too

    tiers = ["device", "disk", "disk", "disk", "disk", "disk", "disk", "device"]
    drop_page_cache(model)
    target, _ = load_llama_target(model, context_tokens=256, threads=2, layer_tiers=tiers, window=1)
    try:
        streamer = target.streamer
        resident = sorted(streamer.resident)
        assert len(resident) == 2
        for layer in resident:
            for span in streamer.spans[layer]:
                cached, pages = cached_pages(model, span.start, span.end)
                assert cached == pages, (layer, cached, pages)
        # The streamer reads its window (+1) ahead of the first pass; past it and away from
        # the resident layers nothing was read. "Away" is beyond the device's readahead: a
        # read or a fault may bring that much in around it (128 KB by default, a layer
        # here is 1.3 MB; some boxes' disks read 8 MB ahead, past every layer of this file).
        ahead = streamer.streamed[:streamer.window + 1]
        reach = device_readahead_bytes(model)
        read = [s for i in resident + ahead for s in streamer.spans[i]]
        far = [i for i in streamer.streamed
               if i not in ahead and all(abs(i - r) > 1 for r in resident) and i - 1 not in ahead
               and all(s.start >= r.end + reach or s.end <= r.start - reach
                       for s in streamer.spans[i] for r in read)]
        counts = [cached_pages(model, s.start, s.end) for i in far for s in streamer.spans[i]]
        cached, pages = sum(c for c, _ in counts), sum(p for _, p in counts)
        assert cached <= pages // 10, (far, cached, pages)
        # and the pass is the resident model's, bit for bit
        prompt = [1, 5, 9, 14, 20, 31]
        target.use_slot(0)
        target.reset()
        target.prefill(prompt)
        streamed = target.verify(prompt, TokenTree.from_root(prompt[-1]))[0].numpy().copy()
    finally:
        target.close()
    whole, _ = load_llama_target(model, context_tokens=256, threads=2)
    try:
        whole.use_slot(0)
        whole.reset()
        whole.prefill(prompt)
        assert np.array_equal(streamed, whole.verify(prompt, TokenTree.from_root(prompt[-1]))[0].numpy())
    finally:
        whole.close()
    if not far:  # checked all but what was read: say so
        pytest.skip(f"the device's readahead ({reach >> 10} KB) reaches every streamed layer of this "
                    f"{model.stat().st_size >> 20} MB file: which layers were read is not checked here")


def test_a_file_system_that_refuses_read_hints_still_loads_and_streams(model, monkeypatch):
    """posix_fadvise is a hint: where it fails, the reads come from the faults, and neither
    the load's read-ahead nor the streamer's thread (which a pass waits on) dies of it."""
    import errno
    import os
    import threading

    from minions_local.backends.llama_load import load_llama_target

    def refuse(*_):
        raise OSError(errno.EINVAL, "no read hints here")

    died = []
    monkeypatch.setattr(os, "posix_fadvise", refuse)
    monkeypatch.setattr(threading, "excepthook", died.append)
    tiers = ["device", "disk", "disk", "disk", "disk", "disk", "disk", "device"]
    target, _ = load_llama_target(model, context_tokens=256, threads=2, layer_tiers=tiers, window=1)
    done = []
    try:
        prompt = [1, 5, 9, 14, 20, 31]
        target.use_slot(0)
        target.reset()
        passes = threading.Thread(target=lambda: done.append(
            target.prefill(prompt) or target.verify(prompt, TokenTree.from_root(prompt[-1]))), daemon=True)
        passes.start()
        passes.join(120)
        assert done, "the pass waited on a streamer thread that had died"
    finally:
        if done:
            target.close()
    assert not died


def test_a_target_read_from_the_start_is_cached_and_its_load_takes_the_reader(model, tmp_path, monkeypatch):
    """What the chat and the server start before torch is imported (planning/target_read_ahead.py):
    the whole file read once, by one reader, which the load then takes as its own."""
    from minions_local.backends import llama_stream
    from minions_local.backends.llama_load import load_llama_target
    from minions_local.planning import target_read_ahead

    monkeypatch.setenv("MINIONS_CACHE_DIR", str(tmp_path / "cache"))
    drop_page_cache(model)
    assert target_read_ahead.read_target_ahead(str(model)) and target_read_ahead.read_target_ahead(model)
    (reader,) = llama_stream._early_readers.values()
    assert reader.wait(60)
    cached, pages = cached_pages(model)
    assert cached == pages
    target, _ = load_llama_target(model, context_tokens=256, threads=2)
    try:
        assert not llama_stream._early_readers
    finally:
        target.close()


def test_only_a_gguf_that_surely_stays_resident_is_read_early(model, tmp_path, monkeypatch):
    """Nothing is read early for a file the plan may stream (over half the memory usable), a
    disk-tier profile's, one split over RPC, a path that is no GGUF, or a profile that does
    not load: each is left to the load, which names what is wrong."""
    from minions_local.backends import llama_stream
    from minions_local.planning import target_read_ahead
    from minions_local.planning.machine_memory import MachineMemory
    from minions_local.profile import load_profile

    size = model.stat().st_size
    monkeypatch.setattr(target_read_ahead, "usable_memory", lambda: MachineMemory(int(1.5 * size), "test", 0))
    assert not target_read_ahead.read_target_ahead(model)
    monkeypatch.setattr(target_read_ahead, "usable_memory", lambda: MachineMemory(100 * size, "test", 0))
    assert not target_read_ahead.read_profile_target_ahead(load_profile("cpu-demo-gguf-disk", target=str(model)))
    assert not target_read_ahead.read_named_profile_target_ahead("cpu-demo", target=str(model), rpc=["127.0.0.1:9"])
    for path in (None, tmp_path / "missing.gguf", tmp_path, str(model) + ".txt"):
        assert not target_read_ahead.read_target_ahead(path)
    assert not target_read_ahead.read_named_profile_target_ahead("no-such-profile", target=str(model))
    assert not llama_stream._early_readers
    assert target_read_ahead.read_named_profile_target_ahead("cpu-demo", target=str(model))
    llama_stream.claim_read_ahead([model]).stop()
    from minions_local.backends import llama_early

    assert list(llama_early._loads) == [("target", str(model.resolve()))]  # cpu-demo computes a GGUF on llama.cpp
    llama_early.drop_early_models()
