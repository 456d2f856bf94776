"""The disk tier's pack files: reuse, rebuild, damage and unwritable places."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from minions_local.core.errors import MemoryPlanError, ModelLoadError
from minions_local.offload import disk, load_streamed_causal_lm
from tests.helpers.offload_helpers import cached_pages, max_diff, one_thread, resident, save_tiny, tree_pass_logits


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.fixture()
def llama(tmp_path):
    return save_tiny(tmp_path, "llama", layers=3)


def packs(cache):
    return sorted(cache.rglob("layer_*.pack"))


def load(path, cache, **kw):
    return load_streamed_causal_lm(path, tier="disk", dtype=torch.float32, cache_dir=cache, **kw)


def test_packs_are_reused_then_rebuilt_when_the_model_changes(llama, tmp_path):
    cache = tmp_path / "cache"
    load(llama, cache)
    first = {p: p.stat().st_mtime_ns for p in packs(cache)}
    assert len(first) == 3 and not list(cache.rglob("*.tmp"))
    load(llama, cache)
    assert {p: p.stat().st_mtime_ns for p in packs(cache)} == first

    save_tiny(tmp_path, "llama", layers=3, seed=7)  # same folder, new weights
    model, _ = load(llama, cache)
    assert all(p.stat().st_mtime_ns != t for p, t in first.items())
    assert max_diff(tree_pass_logits(model, steps=1), tree_pass_logits(resident(llama), steps=1)) <= 1e-5


def test_truncated_pack_is_named(llama, tmp_path):
    cache = tmp_path / "cache"
    load(llama, cache)
    victim = packs(cache)[1]
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - 4096)
    with pytest.raises(ModelLoadError, match="layer_0001.pack") as err:
        load(llama, cache)
    assert "truncated" in str(err.value) and "Delete it" in str(err.value)


def test_corrupt_header_is_named(llama, tmp_path):
    cache = tmp_path / "cache"
    load(llama, cache)
    victim = packs(cache)[0]
    with open(victim, "r+b") as f:
        f.write(b"GARBAGE!")
    with pytest.raises(ModelLoadError, match=f"{victim}.*bad magic"):
        load(llama, cache)


def test_corrupt_payload_is_found_on_first_read(llama, tmp_path):
    cache = tmp_path / "cache"
    load(llama, cache)
    victim = packs(cache)[2]
    with open(victim, "r+b") as f:
        f.seek(-5000, os.SEEK_END)
        f.write(b"\xff" * 64)
    model, _ = load(llama, cache)  # only layer 0 is read at load time
    with pytest.raises(ModelLoadError, match="layer_0002.pack.*checksum"):
        tree_pass_logits(model, steps=0)


def test_unwritable_cache_dir_is_named(llama, tmp_path, monkeypatch):
    cache = tmp_path / "readonly"
    if os.geteuid() == 0:  # root writes through permission bits: simulate a read-only mount
        def refuse(path):
            raise OSError(errno.EROFS, "Read-only file system", str(path))

        monkeypatch.setattr(disk, "_create_file", refuse)
    else:
        cache.mkdir()
        cache.chmod(0o555)
    with pytest.raises(MemoryPlanError, match=f"{cache}.*(Read-only|Permission).*cache_dir"):
        load(llama, cache)


def test_full_disk_is_named(llama, tmp_path, monkeypatch):
    class Usage:
        free = 10_000

    monkeypatch.setattr(disk.shutil, "disk_usage", lambda _p: Usage)
    with pytest.raises(MemoryPlanError, match=f"GB for layer packs in {tmp_path / 'cache'}.*free"):
        load(llama, tmp_path / "cache")


def test_no_o_direct_falls_back_visibly(llama, tmp_path, monkeypatch):
    def refuse(path):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(disk, "open_direct", refuse)
    model, stats = load(llama, tmp_path / "cache")
    assert stats.read_mode == "fadvise"
    assert any("O_DIRECT" in w for w in stats.warnings)
    assert max_diff(tree_pass_logits(model, steps=1), tree_pass_logits(resident(llama), steps=1)) <= 1e-5


def test_streaming_leaves_the_page_cache_empty(llama, tmp_path):
    """The disk tier reads around the page cache, so a model bigger than RAM streams and
    the measured speed is the disk's."""
    model, stats = load(llama, tmp_path / "cache")
    tree_pass_logits(model, steps=2)
    if stats.read_mode != "o_direct":
        pytest.skip("this file system refuses O_DIRECT")
    for pack in packs(tmp_path / "cache"):
        cached, total = cached_pages(pack)
        assert cached == 0, f"{pack}: {cached} of {total} pages in the page cache"


def test_disk_filling_up_while_packing_is_named(llama, tmp_path, monkeypatch):
    real_create = disk._create_file

    class Full:
        def __init__(self, path):
            self.f = real_create(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def close(self):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk, "_create_file", Full)
    with pytest.raises(MemoryPlanError, match="disk filled up while writing .*layer_0000.pack"):
        load(llama, tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.tmp"))


def _vm_flags(address: int) -> list[str] | None:
    """The VmFlags of the mapping holding address (Linux /proc/self/smaps), or None."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


def test_big_host_buffers_are_advised_onto_huge_pages_and_keep_their_memory():
    """O_DIRECT reads into scattered 4 KiB pages ran 15-45% slower on the project's VM,
    so layer buffers and RAM-tier layers ask for transparent huge pages."""
    import gc
    import mmap

    from minions_local.offload.layout import BLOCK, HUGE_PAGE, aligned_empty

    big = aligned_empty(3 * HUGE_PAGE + 123)
    assert big.numel() == 3 * HUGE_PAGE + 123 and big.data_ptr() % BLOCK == 0
    gc.collect()  # the tensor alone must keep its mapping alive
    big.fill_(7)
    assert int(big[0]) == int(big[-1]) == 7
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert big.data_ptr() % HUGE_PAGE == 0
        flags = _vm_flags(big.data_ptr())
        assert flags is None or "hg" in flags, flags
    small = aligned_empty(5000)  # below a huge page: torch's allocator, still aligned
    assert small.numel() == 5000 and small.data_ptr() % BLOCK == 0
