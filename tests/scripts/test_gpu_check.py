"""scripts/gpu_check.py, the GPU check: what travels to the lent machine fits one call,
the CPU rehearsal runs every step as the GPU will, and its parts say what they must."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gpu_check
import pytest
import torch
from gpucheck import record, travel
from gpucheck.parting import first_parting, judge

from tests.helpers.tiny_models import hf_greedy, random_model, tiny_config

REPO = Path(__file__).resolve().parents[2]
# What the lent GPU image lacks (KINDS.md): the rehearsal must not need any of it.
NOT_ON_THE_IMAGE = ("textual", "gguf", "llama_cpp", "starlette", "uvicorn")


def test_what_travels_fits_one_call():
    plan = travel.manifest(REPO)
    files = plan["files"]
    assert plan["total_bytes"] <= travel.LIMIT, travel.describe(plan, "HEAD")
    assert any(name.startswith(f"{travel.DEMO}/target/") for name in files)
    assert any(name.startswith(f"{travel.DEMO}/{travel.TRAVELLING_MINION}/") for name in files)
    assert plan["left_behind"] and not any(name.startswith(tuple(plan["left_behind"])) for name in files)
    assert "scripts/gpu_check.py" in files and plan["carry"] == [travel.WHEEL_DIR]
    assert plan["wheel_bytes"] > 0 and len(plan["carry"]) <= 8
    command = travel.device_command("abc1234")
    assert len(command) <= 2000 and "--commit abc1234" in command and travel.WHEEL_DIR in command


def test_the_rehearsal_runs_every_step_without_what_the_gpu_image_lacks(tmp_path):
    """`--device cpu --quick`, as CI runs it, with the packages the GPU image lacks
    made unimportable (a sitecustomize on PYTHONPATH reaches every step's process)."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        f"BLOCKED = {NOT_ON_THE_IMAGE!r}\n"
        "class Absent(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (not on the GPU image)')\n"
        "sys.meta_path.insert(0, Absent())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(REPO)]),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the image has none of our pytest plugins either
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--out", str(out),
                           "--commit", "rehearsal"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    result = json.loads((out / "gpu_check.json").read_text())
    steps = result["steps"]
    failed = {name: s.get("tail", "")[-1500:] for name, s in steps.items() if s.get("rc") != 0}
    assert proc.returncode == 0 and not failed, failed or proc.stderr[-2000:]
    assert len(list(out.iterdir())) <= 8 and (out / "curve-70b.png").stat().st_size > 10_000
    assert list(steps) == list(gpu_check.STEPS) and result["ok"] and result["commit"] == "rehearsal"
    assert len(result["code"]["fingerprint"]) == 16
    assert steps["env"]["result"]["missing_carried"] == [] and "ram_gbps" in steps["env"]["result"]
    assert steps["tests"]["counts"]["passed"] == 3  # the GPU tests ran, on the CPU
    assert {r["test"] for r in steps["tests"]["records"]} == {"greedy", "sampling"}
    curve = steps["curve"]["result"]
    for quant in ("int4", "bf16"):
        assert set(curve[quant]["pass_ms"]) == {"0", "3", "6"} and "copy_efficiency" in curve[quant]
        assert all(v > 0 for pts in curve[quant]["pass_ms"].values() for v in pts.values())
        assert "rtx4090-70b" in curve[quant]["projection"], curve[quant]["projection"]
    chat = steps["chat"]["result"]
    assert chat["identical"] and chat["tokens_per_pass"] > 1 and chat["autoregressive_tok_s"] > 0
    assert chat["target_streams_from"] == ["disk"] and "kernel launches" in chat["note"]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["chat"]["identical"] and summary["tests"]["partings"] == 0


def test_steps_without_the_time_they_need_are_skipped_not_started(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--budget-s", "5",
                           "--steps", "tests,curve,chat"]) == 0
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert all(s["rc"] is None and "budget left" in s["skipped"] for s in steps.values())
    assert not (tmp_path / "curve-70b.png").exists()
    assert "skipped" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["chat"]


def test_each_step_leaves_the_later_ones_what_they_need():
    args = gpu_check.argparse.Namespace(device="cuda", steps=list(gpu_check.STEPS))
    assert gpu_check.step_seconds("tests", args, 400) == gpu_check.MAX_S["tests"]
    curve = gpu_check.step_seconds("curve", args, 300)
    assert curve == 300 - gpu_check.NEEDS["chat"][0] - 10
    assert gpu_check.step_seconds("curve", args, 50) == gpu_check.NEEDS["curve"][0]  # never less than it needs


def test_unknown_steps_and_a_missing_gpu_are_named_not_tracebacks(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--steps", "env,warp"]) == 2
    assert "warp" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert gpu_check.main(["--out", str(tmp_path)]) == 2
        assert "--device cpu --quick" in capsys.readouterr().err


def test_pytest_closing_counts():
    assert gpu_check.pytest_summary("...\n3 passed, 2 skipped, 17 deselected in 9.1s\n") == {
        "counts": {"passed": 3, "skipped": 2, "deselected": 17}}
    counts = gpu_check.pytest_summary("x\n1 failed, 4 passed in 2.0s")["counts"]
    assert counts["failed"] == 1 and counts["passed"] == 4
    assert gpu_check.pytest_summary("collection error") == {}


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          capture_output=True, text=True)


def test_slim_takes_the_other_minions_out_of_the_index_and_unslim_puts_them_back(tmp_path):
    repo = tmp_path / "repo"
    for member in ("target", "minion-qwen2-xs", "minion-llama-s", "minion-mistral-m"):
        folder = repo / travel.DEMO / member
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(os.urandom(1000))
    (repo / "README.md").write_text("x\n")
    assert _git(repo, "init", "-q").returncode == 0
    _git(repo, "add", ".")
    assert _git(repo, "commit", "-q", "-m", "init").returncode == 0
    behind = [f"{travel.DEMO}/minion-llama-s", f"{travel.DEMO}/minion-mistral-m"]
    assert travel.left_behind(repo) == behind

    report = travel.slim(repo, download=False)
    assert "command: " in report and travel.is_slim(repo)
    listed = travel.listed(repo)
    assert not any(n.startswith(tuple(behind)) for n in listed)
    assert f"{travel.DEMO}/target/model.safetensors" in listed
    assert all((repo / p / "model.safetensors").exists() for p in behind)  # still on disk
    refused = _git(repo, "commit", "-q", "--allow-empty", "-m", "while slim")
    assert refused.returncode != 0 and "--unslim" in refused.stderr

    assert "back in the index" in travel.unslim(repo)
    assert not travel.is_slim(repo) and _git(repo, "status", "--porcelain").stdout == ""
    assert all(f"{p}/model.safetensors" in travel.listed(repo) for p in behind)
    assert _git(repo, "commit", "-q", "--allow-empty", "-m", "after").returncode == 0


def test_first_parting():
    assert first_parting([1, 2, 3], [1, 2, 3]) is None
    assert first_parting([1, 5, 3], [1, 2, 3]) == 1
    assert first_parting([1, 2], [1, 2, 3]) == 2  # one reply stopped where the other went on


@pytest.fixture(scope="module")
def bf16_model():
    return random_model(tiny_config("llama"), seed=3, scale=4.0).to(torch.bfloat16)


def _ranked(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        return torch.argsort(model(torch.tensor([ids])).logits[0, -1].float(), descending=True).tolist()


def test_a_parting_at_the_runner_up_is_measured_and_one_at_a_poor_token_is_no_near_tie(bf16_model):
    prompt = [5, 9, 17]
    alone = hf_greedy(bf16_model, prompt, 6, eos=None)
    ranked = _ranked(bf16_model, prompt + alone[:2])
    runner_up = [t for t in ranked[:2] if t != alone[2]][0]
    p = judge(bf16_model, prompt, alone[:2] + [runner_up, 7], alone, stop=None)
    assert p.position == 2 and p.alone == alone[2] and p.ours == runner_up and p.in_top2
    assert p.pair_margin == pytest.approx(p.top2_margin, abs=1e-6)
    assert p.near_tie == (p.pair_margin <= p.tolerance) and p.tolerance >= 4 * 2**-7
    poor = judge(bf16_model, prompt, alone[:2] + [ranked[-1]], alone, stop=None)
    assert not poor.near_tie and not poor.in_top2 and poor.pair_margin > poor.tolerance
    assert judge(bf16_model, prompt, alone, alone, stop=None) is None
    stopped = judge(bf16_model, prompt, alone[:3], alone, stop=None)
    assert stopped.position == 3 and stopped.pair_margin is None and not stopped.near_tie


def test_an_exact_tie_is_a_near_tie(bf16_model):
    """Two tokens with the same head row: either is the target's choice."""
    tied = random_model(tiny_config("llama"), seed=3, scale=4.0).to(torch.bfloat16)
    prompt = [5, 9, 17]
    best, second = _ranked(tied, prompt)[:2]
    with torch.no_grad():
        tied.lm_head.weight[second] = tied.lm_head.weight[best]
    p = judge(tied, prompt, [second], [best], stop=None)
    assert p.position == 0 and p.pair_margin == 0 and p.near_tie and p.in_top2


def test_docs_gpu_keeps_gpu_runs_and_says_when_the_check_is_due(tmp_path):
    run = tmp_path / "out" / "gpu_check.json"
    run.parent.mkdir()
    data = {"device": "cuda", "started": "2026-12-01T10:00:00+0000", "code": {"fingerprint": record.code_fingerprint()},
            "steps": {"env": {"result": {"gpu": "NVIDIA H100 80GB HBM3"}}}}
    run.write_text(json.dumps(data))
    (run.parent / "curve-70b.png").write_bytes(b"png")
    docs = tmp_path / "docs" / "gpu"
    assert record.due(docs)[0]
    kept = record.keep(run, docs)
    assert [p.name for p in kept] == ["2026-12-01-nvidia-h100-80gb-hbm3.json", "2026-12-01-nvidia-h100-80gb-hbm3.png"]
    assert not record.due(docs)[0]
    again = record.keep(run, docs)  # a second run that day is kept beside the first, not over it
    assert [p.name for p in again] == ["2026-12-01-nvidia-h100-80gb-hbm3-2.json",
                                       "2026-12-01-nvidia-h100-80gb-hbm3-2.png"]
    again[0].unlink()
    data["code"]["fingerprint"] = "0" * 16  # older code: due again
    kept[0].write_text(json.dumps(data))
    assert record.due(docs)[0]
    run.write_text(json.dumps({**data, "device": "cpu"}))
    with pytest.raises(ValueError, match="rehearsal"):
        record.keep(run, docs)
