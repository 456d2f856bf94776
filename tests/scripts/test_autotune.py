"""autotune writes a profile that load_profile reads; the TOML writer round-trips."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from autotuning.measure import disk_read_speeds

from minions_local.planning.cost_prior import cost_model_from_profile
from minions_local.planning.memory_plan import plan_memory
from minions_local.profile import load_profile
from minions_local.profile.writer import dumps

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "autotune.py"


def test_tiny_autotune_writes_a_loadable_profile(tmp_path):
    out = tmp_path / "generated" / "here.toml"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--profile", "stdlib-demo", "--out", str(out), "--disk-path",
         str(tmp_path / "disk")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])  # ONE JSON line, last
    assert summary["profile"] == str(out) and summary["mode"] == "tiny"
    assert summary["disk_read_fadvise_gbps"] > 0 and summary["memcpy_gbps"] > 0
    profile = load_profile(out)
    hw = profile.hardware
    assert hw.disk_read_gbps > 0 and hw.host_to_device_gbps > 0 and hw.device_memory_gbps > 0
    assert set(hw.compute_tflops) >= {"bfloat16", "float32"}
    assert profile.measurements is not None and profile.measurements.matmul
    assert profile.target.path.endswith("demo_models/target")  # the template's models, resolved
    assert not list((tmp_path / "disk").iterdir())  # the probe file is gone
    plan = plan_memory(profile)
    assert cost_model_from_profile(profile, plan).t_verify(0) > 0


def test_autotune_refuses_to_write_over_shipped_profiles():
    shipped = Path(load_profile("cpu-demo").source)
    before = shipped.read_text()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(shipped)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "hand-written" in proc.stderr
    assert shipped.read_text() == before


def test_disk_probe_reports_all_three_reads(tmp_path):
    speeds = disk_read_speeds(tmp_path, 16 << 20)
    assert speeds["fadvise"] > 0 and speeds["cached"] > 0
    assert speeds["direct"] is None or speeds["direct"] > 0  # tmpfs refuses O_DIRECT
    assert list(tmp_path.iterdir()) == []


def test_writer_round_trips_a_shipped_profile(tmp_path):
    source = Path(load_profile("rtx4090-70b").source)
    data = tomllib.loads(source.read_text())
    text = dumps(data, header="copy")
    assert text.startswith("# copy")
    assert tomllib.loads(text) == data
    path = tmp_path / "copy.toml"
    path.write_text(text)
    assert load_profile(path).model_dump(exclude={"name"}) == load_profile("rtx4090-70b").model_dump(exclude={"name"})


def test_writer_keeps_small_timings():
    assert tomllib.loads(dumps({"t": 2.5e-05, "n": 3.0}))["t"] == pytest.approx(2.5e-05)
    with pytest.raises(ValueError):
        dumps({"t": float("nan")})


# -- CUDA: run when a GPU is present (pytest -m gpu) -------------------------------------------

def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


needs_cuda = pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_copies_memory_and_matmuls():
    from autotuning.measure import copy_speeds, matmul_tflops, weight_read_gbps

    speeds = copy_speeds(256 << 20, 0.2)
    assert speeds["pinned"] > 2 and speeds["pageable"] > 0.5
    assert speeds["pinned"] >= 0.8 * speeds["pageable"]  # pinned is the fast path the layer store uses
    assert weight_read_gbps("cuda", "float16", 256 << 20, 0.2) > 100
    assert matmul_tflops("cuda", "float16", 4096, 0.2) > 5


@pytest.mark.gpu
@needs_cuda
def test_quick_autotune_on_cuda_with_the_70b_template(tmp_path):
    out = tmp_path / "gpu.toml"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--profile", "rtx4090-70b", "--out", str(out),
         "--disk-path", str(tmp_path / "disk")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["device"] == "cuda" and summary["host_to_device_pinned_gbps"] > 2
    profile = load_profile(out)
    assert profile.hardware.device == "cuda" and profile.hardware.host_to_device_pageable_gbps
    plan = plan_memory(profile)
    assert cost_model_from_profile(profile, plan).t_verify(0) > 0
