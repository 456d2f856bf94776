"""The benchmark's machinery on tiny random stand-ins: every method runs, the figures
are consistent, and the JSON line has what the issue asks for."""

import json
from pathlib import Path

from benchmarks.methods import Run
from benchmarks.report import goal_checks, prediction_errors, summarize

from minions_local.core.events import StepRecord


def test_bench_tiny_end_to_end(tmp_path, capsys):
    import bench  # sets its environment defaults (offline hub, passive OpenMP) on import

    assert bench.main(["--tiny", "--out", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    for key in ("profile", "tier", "prompts", "methods", "goals", "prediction_error", "accepted_histogram",
                "best_transformers", "best_fixed", "plot", "standins"):
        assert key in result, key
    methods = result["methods"]
    families = {m["family"] for m in methods.values()}
    assert {"autoregressive", "transformers", "chain", "fixed", "adaptive"} <= families
    assert methods["autoregressive"]["all"]["vs_autoregressive"] == 1.0
    for name, m in methods.items():
        for mode in ("greedy", "sampled", "all"):
            assert m[mode]["tokens"] > 0 and m[mode]["passes"] > 0, (name, mode)
        if m["family"] in ("chain", "fixed", "adaptive"):
            assert m["greedy"]["greedy_identical"] == 1.0, name  # lossless: the target's own tokens
    assert set(result["goals"]) == {"disk_vs_autoregressive", "ram_vs_best_transformers", "adaptive_vs_best_fixed",
                                    "step_time_prediction_error"}
    assert Path(result["plot"]).is_file() and Path(result["plot"]).stat().st_size > 0


def _run(tokens: int, seconds: float, passes: int, steps=()) -> Run:
    return Run(list(range(tokens)), seconds, passes, list(steps))


def test_ratios_are_per_round_and_goals_read_them():
    class M:
        def __init__(self, name, family):
            self.name, self.family, self.threads, self.detail = name, family, 1, ""

    methods = [M("autoregressive", "autoregressive"), M("hf", "transformers"), M("fixed 8", "fixed"),
               M("adaptive", "adaptive")]
    # Round 2 runs on a machine 4x slower: the ratios must not notice.
    rounds = [
        {"autoregressive": _run(10, 1.0, 10), "hf": _run(10, 0.5, 10), "fixed 8": _run(10, 0.25, 4),
         "adaptive": _run(10, 0.2, 3)},
        {"autoregressive": _run(10, 4.0, 10), "hf": _run(10, 2.0, 10), "fixed 8": _run(10, 1.0, 4),
         "adaptive": _run(10, 0.8, 3)},
    ]
    summary = summarize(rounds, ["greedy", "sampled"])
    assert abs(summary["adaptive"]["all"].vs_baseline - 5.0) < 1e-9
    assert abs(summary["hf"]["all"].vs_baseline - 2.0) < 1e-9
    step = StepRecord(tree_size=8, accepted=2, t_grow=0.01, t_verify=0.09, predicted_t_verify=0.1,
                      predicted_t_grow=0.01)
    errors = prediction_errors([_run(3, 0.1, 1, [step])])
    assert abs(errors["step"] - 0.1) < 1e-3
    goals = goal_checks("ram", summary, methods, errors)
    assert goals["ram_vs_best_transformers"]["value"] == 2.5 and goals["ram_vs_best_transformers"]["passed"]
    assert goals["disk_vs_autoregressive"]["passed"] is None  # not this tier
    assert goals["adaptive_vs_best_fixed"]["value"] == 1.25
    assert goals["step_time_prediction_error"]["passed"]
