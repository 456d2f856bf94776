"""bench_stream.py's machinery: the raw-read yardstick, the synthetic target, and
which bound a streamed pass is under (so which figure it may claim)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from benchmarks.raw_reads import read_files_direct
from benchmarks.stream_bound import stream_bound
from benchmarks.synthetic import SyntheticStack

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
    # One landing buffer a file: with fewer, files k and k+2 share one and nothing
    # orders their range reads across threads (no barrier between files), so which
    # file a shared buffer holds at the end is a race (CI saw file k-2's bytes win).
    landing = [aligned_empty(max(sizes)) for _ in files]
    assert read_files_direct(files, scratch, landing=landing) == sum(sizes)
    for k, path in enumerate(files):
        data = path.read_bytes()
        assert bytes(landing[k][: len(data)].numpy()) == data


def test_synthetic_target_streams_its_real_byte_count():
    model, stats = SyntheticStack("demo", layers=2, quant="int4", dtype=torch.float32).model()
    logits = tree_pass_logits(model, steps=1)
    assert all(torch.isfinite(x).all() for x in logits)
    assert stats.bytes_streamed == 2 * stats.bytes_per_pass
    assert stats.bytes_per_pass < 2 * 3.2e6 * 0.6  # ~3.2M params per layer at ~0.53 bytes each


def test_a_pass_that_computes_longer_than_it_reads_claims_the_hidden_fraction():
    """Issue 25's box: SmolLM2's 212 MB per pass at ~6 GB/s is ~35 ms of reads under
    ~90 ms of compute; achieved / raw is then ~0.39 with almost every read hidden."""
    bound = stream_bound(bytes_per_pass=212e6, seconds_per_pass=0.090, waiting_per_pass=0.0007, raw_gbps=6.0)
    assert bound.bound == "compute"
    assert abs(bound.read_ms - 35.3) < 0.1 and abs(bound.compute_ms - 89.3) < 0.1
    assert round(bound.efficiency, 2) == 0.39
    assert bound.figure == ("read_hidden_fraction", bound.hidden_fraction) and round(bound.hidden_fraction, 2) == 0.98
    assert "compute-bound" in bound.describe() and "98% of the read time hidden" in bound.describe()
    assert bound.as_json()["figure"] == "read_hidden_fraction"


def test_a_pass_that_waits_on_its_reads_claims_the_stream_efficiency():
    """The AVX-512 EPYC's baseline: 110 ms a pass, 1.91 GB/s of a raw 2.19."""
    bound = stream_bound(bytes_per_pass=212e6, seconds_per_pass=0.111, waiting_per_pass=0.050, raw_gbps=2.19)
    assert bound.bound == "read" and bound.compute_ms < bound.read_ms
    assert bound.figure == ("stream_efficiency", bound.efficiency) and round(bound.efficiency, 2) == 0.87
    assert "read-bound" in bound.describe()


def test_a_pass_whose_reads_run_late_is_not_flattered():
    """Compute longer than the reads at raw speed, yet the reads ran so slowly that
    compute waited: the hidden fraction says so (half the read time was not hidden)."""
    bound = stream_bound(bytes_per_pass=100e6, seconds_per_pass=0.080, waiting_per_pass=0.025, raw_gbps=2.0)
    assert bound.bound == "compute" and bound.hidden_fraction == 0.5
    never_waited = stream_bound(bytes_per_pass=100e6, seconds_per_pass=0.080, waiting_per_pass=0.0, raw_gbps=2.0)
    assert never_waited.hidden_fraction == 1.0


def test_the_default_model_is_smollm2_not_the_toy(monkeypatch, tmp_path):
    """Issue 25: the stdlib toy's passes are compute-bound on any CPU, so measuring it
    by default said nothing about streaming the model people run."""
    import bench_stream

    from minions_local.engine import loading
    from minions_local.models.builtin import SMOLLM2, builtin_path

    asked = []
    monkeypatch.setattr(loading, "prepare_builtin", lambda path, progress: asked.append(path) or tmp_path)
    assert bench_stream.model_folder(None) == tmp_path
    assert asked == [builtin_path(SMOLLM2)]
    assert bench_stream.model_folder(Path("demo")) == bench_stream.DEMO_TARGET
    assert bench_stream.model_folder(tmp_path / "mine") == tmp_path / "mine"
