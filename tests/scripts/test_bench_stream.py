"""bench_stream.py's machinery: the raw-read yardstick and the synthetic target."""

from __future__ import annotations

import pytest
import torch
from benchmarks.raw_reads import read_files_direct
from benchmarks.synthetic import synthetic_streamed_causal_lm

from minions_local.offload import load_streamed_causal_lm
from minions_local.offload.layout import aligned_empty
from tests.helpers.offload_helpers import one_thread, save_tiny, tree_pass_logits


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def test_raw_reads_count_every_byte_and_land_where_asked(tmp_path):
    """The benchmark's yardstick: whole files, split across threads; with `landing`,
    file k ends up intact in landing[k % len(landing)]."""
    cache = tmp_path / "cache"
    load_streamed_causal_lm(save_tiny(tmp_path, "llama", layers=3), tier="disk", dtype=torch.float32,
                            cache_dir=cache)
    files = sorted(cache.rglob("layer_*.pack"))
    sizes = [p.stat().st_size for p in files]
    scratch = [aligned_empty(1 << 20) for _ in range(3)]
    assert read_files_direct(files * 2, scratch) == 2 * sum(sizes)
    landing = [aligned_empty(max(sizes)) for _ in range(2)]
    assert read_files_direct(files, scratch, landing=landing) == sum(sizes)
    for k in (len(files) - 2, len(files) - 1):  # the last file to land in each buffer
        data = files[k].read_bytes()
        assert bytes(landing[k % 2][: len(data)].numpy()) == data


def test_synthetic_target_streams_its_real_byte_count():
    model, stats = synthetic_streamed_causal_lm("demo", layers=2, quant="int4", dtype=torch.float32)
    logits = tree_pass_logits(model, steps=1)
    assert all(torch.isfinite(x).all() for x in logits)
    assert stats.bytes_streamed == 2 * stats.bytes_per_pass
    assert stats.bytes_per_pass < 2 * 3.2e6 * 0.6  # ~3.2M params per layer at ~0.53 bytes each
