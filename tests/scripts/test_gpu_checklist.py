"""The GPU checklist runner (scripts/gpu_checklist.py): what it records and when it
refuses to start a step. The steps themselves are the benchmarks' own scripts, tested
where they live; here nothing slow runs."""

from __future__ import annotations

import json

import gpu_checklist


def test_env_step_records_the_machine_and_ends_with_one_json_line(tmp_path, capsys):
    assert gpu_checklist.main(["--out", str(tmp_path), "--steps", "env", "--device", "cpu"]) == 0
    record = json.loads((tmp_path / "checklist.json").read_text())
    env = record["env"]["result"]
    assert env["torch"] and env["cuda_available"] in (True, False) and "has_textual" in env
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["env"]["rc"] == 0


def test_a_step_that_would_outlast_the_budget_is_skipped_not_started(tmp_path):
    code = gpu_checklist.main(["--out", str(tmp_path), "--steps", "tests-all", "--device", "cpu",
                               "--budget-s", "30"])
    record = json.loads((tmp_path / "checklist.json").read_text())
    assert code == 0 and record["tests-all"]["rc"] is None
    assert "budget left" in record["tests-all"]["skipped"]


def test_unknown_steps_are_named(tmp_path, capsys):
    assert gpu_checklist.main(["--out", str(tmp_path), "--steps", "env,warp-drive"]) == 2
    assert "warp-drive" in capsys.readouterr().err


def test_a_timed_out_step_keeps_what_it_printed(tmp_path):
    step = gpu_checklist.Step("sleepy", [gpu_checklist.PY, "-c",
                                         "import time; print('started', flush=True); time.sleep(30)"], 1)
    with open(tmp_path / "log.txt", "w") as log:
        result = gpu_checklist.run_step(step, log, timeout=2)
    assert result["rc"] == "timeout" and "started" in result["tail"]


def test_last_json_line_and_merge(tmp_path):
    assert gpu_checklist.last_json('noise\n{"a": 1}\n{broken\n') == {"a": 1}
    assert gpu_checklist.last_json("no json here") is None
    first, second = tmp_path / "1.json", tmp_path / "2.json"
    first.write_text(json.dumps({"env": {"rc": 0}, "tests-gpu": {"rc": 1}}))
    second.write_text(json.dumps({"tests-gpu": {"rc": 0}}))
    into = tmp_path / "gpu" / "record.json"
    assert gpu_checklist.main(["merge", str(first), str(second), "--into", str(into)]) == 0
    assert json.loads(into.read_text()) == {"env": {"rc": 0}, "tests-gpu": {"rc": 0}}
