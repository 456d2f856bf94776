"""The chat benchmark's machinery on tiny random stand-ins: every method runs, the
figures are consistent and taken against the same run's baseline, and the JSON line
has what issue 14 asks for."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from benchmarks.chat_prompts import CHAT_PROMPTS, calibration_prompt, chat_prompts
from benchmarks.llama_child import MethodFailed
from benchmarks.memlimit import ROOT, MemoryGroup, NoMemoryGroup
from benchmarks.methods import Method, Run
from benchmarks.report import (bytes_per_pass, goal_checks, physical_bound, prediction_errors, stream_efficiency,
                               summarize, time_split)
from benchmarks.rounds import calibrate, interleaved
from benchmarks.stream_bound import stream_bound

from minions_local.core.events import StepRecord

JSON_KEYS = ("profile", "tier", "prompts", "ratios", "tokens_per_pass", "tokens_per_s", "bytes_per_pass",
             "raw_read_gbps", "stream_efficiency", "stream_bound", "physical_bound_tokens_per_s",
             "adaptive_vs_best_fixed",
             "best_fixed", "step_time_prediction_error", "prediction_error", "calibration", "methods", "goals",
             "accepted_histogram", "notes", "failures", "plot")


@pytest.mark.parametrize("tier", ["disk", "ram"])
def test_bench_tiny_end_to_end(tier, tmp_path, capsys):
    import bench  # sets its environment defaults (offline hub, passive OpenMP) on import

    assert bench.main(["--tiny", "--tier", tier, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    for key in JSON_KEYS:
        assert key in result, key
    disk = tier == "disk"
    assert result["tier"] == tier and result["modes"] == ["greedy", "sampled"]
    assert result["profile"] == ("stdlib-demo-disk" if disk else "stdlib-demo")
    methods = result["methods"]
    families = {m["family"] for m in methods.values()}
    assert {"autoregressive", "adaptive", "adaptive-all", "fixed", "transformers"} <= families
    assert {"hf", "hf prompt-lookup"} <= set(methods) and any(n.startswith("hf assisted") for n in methods)
    try:
        import llama_cpp  # noqa: F401

        assert {"llama.cpp", "llama.cpp prompt-lookup"} <= set(methods)
        limited = any("memory group" in n or "WITHOUT a memory limit" in n for n in result["notes"])
        assert limited == disk  # only a disk-tier model is too large for memory
        assert [bool(d["page_cache_dropped_per_run"]) for d in result["llama_cpp"]] == [disk]
    except ImportError:
        assert any("llama.cpp skipped" in n for n in result["notes"])
    for mode in ("greedy", "sampled", "all"):
        assert result["ratios"][mode]["autoregressive"] == 1.0
    for name, m in methods.items():
        assert m["bytes_per_pass"] >= 0 and m["threads"] == 1 and m["dtype"]
        for mode in ("greedy", "sampled", "all"):
            assert m[mode]["tokens"] > 0 and m[mode]["passes"] > 0, (name, mode)
            assert result["ratios"][mode][name] == m[mode]["vs_autoregressive"]
        if m["family"] in ("autoregressive", "fixed", "adaptive", "adaptive-all"):
            assert m["greedy"]["greedy_identical"] == 1.0, name  # lossless: the target's own tokens
            assert m["bytes_per_pass"] > 0, name  # streamed from the run's own packs, or read from RAM
    if disk:
        assert result["raw_read_gbps"] > 0 and result["stream_efficiency"]["efficiency"] > 0
        assert result["physical_bound_tokens_per_s"] > 0
        assert result["raw_read_gbps"] == max(result["raw_reads_gbps"])  # the best the disk did
        # The baseline's goal line is the figure its bound allows: one of the two applies.
        bound = result["stream_bound"]
        assert bound["bound"] in ("read", "compute") and 0 <= bound["hidden_fraction"] <= 1
        applies = {k: result["goals"][k]["applies"] for k in
                   ("autoregressive_stream_efficiency", "autoregressive_read_hidden_fraction")}
        assert applies == {"autoregressive_stream_efficiency": bound["bound"] == "read",
                           "autoregressive_read_hidden_fraction": bound["bound"] == "compute"}
        assert f"autoregressive passes are {bound['bound']}-bound" in "\n".join(out)
    else:
        assert result["raw_read_gbps"] is None and result["physical_bound_tokens_per_s"] is None
        assert result["stream_bound"] is None
        assert result["goals"]["disk_greedy_vs_autoregressive"]["passed"] is None
    assert result["time_split"]["autoregressive"]["vs_autoregressive_growing_free"] > 0
    assert result["goals"]["adaptive_vs_best_fixed"]["value"] == result["adaptive_vs_best_fixed"]
    assert Path(result["plot"]).is_file() and Path(result["plot"]).stat().st_size > 0
    assert "bound tok/s" in "\n".join(out)  # the human table came first
    assert not list(ROOT.glob(f"minions-bench-{os.getpid()}-*"))  # its memory groups are gone


def test_chat_prompts_are_varied_and_go_through_the_template():
    kinds = {kind for kind, _ in CHAT_PROMPTS}
    assert len(CHAT_PROMPTS) >= 8 and {"explanation", "code", "list", "letter", "summary"} <= kinds

    class Templated:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
            assert add_generation_prompt and tokenize and not return_dict
            return [7, len(messages[0]["content"])]

    class Plain:
        chat_template = None

        def encode(self, text, add_special_tokens):
            return [len(text)]

    prompts = chat_prompts(Templated(), 8)
    assert [p.ids for p in prompts] == [[7, len(text)] for _, text in CHAT_PROMPTS[:8]]
    assert chat_prompts(Plain(), 1)[0].ids == [len(f"User: {CHAT_PROMPTS[0][1]}\nAssistant:")]
    assert calibration_prompt(Plain()).text not in {text for _, text in CHAT_PROMPTS}  # never measured
    with pytest.raises(ValueError, match="--prompts"):
        chat_prompts(Plain(), len(CHAT_PROMPTS) + 1)


def _run(tokens: int, seconds: float, passes: int, steps=(), **extra) -> Run:
    return Run(list(range(tokens)), seconds, passes, list(steps), **extra)


class _M(Method):
    """A method whose runs take a fixed time (or fail)."""

    def __init__(self, name, family, seconds=1.0, dtype="bf16", threads=1, fail=False):
        super().__init__(name, family, threads, "", dtype, 1000)
        self.seconds, self.fail, self.calls = seconds, fail, 0

    def run(self, ids, max_new, temperature, seed):
        self.calls += 1
        if self.fail:
            raise MethodFailed("killed")
        return _run(max_new, self.seconds, max_new)


def test_ratios_are_per_round_and_goals_read_them():
    methods = [_M("autoregressive", "autoregressive"), _M("hf", "transformers"), _M("fixed 8", "fixed"),
               _M("adaptive", "adaptive"), _M("all", "adaptive-all"), _M("llama.cpp", "llama.cpp")]
    # Round 2 runs on a machine 4x slower: the ratios must not notice.
    rounds = [
        {"autoregressive": _run(10, 1.0, 10), "hf": _run(10, 2.0, 10), "fixed 8": _run(10, 0.25, 4),
         "adaptive": _run(10, 0.125, 2), "all": _run(10, 0.25, 2), "llama.cpp": _run(10, 0.1, 10)},
        {"autoregressive": _run(10, 4.0, 10), "hf": _run(10, 8.0, 10), "fixed 8": _run(10, 1.0, 4),
         "adaptive": _run(10, 0.5, 2), "all": _run(10, 1.0, 2), "llama.cpp": _run(10, 0.4, 10)},
    ]
    summary = summarize(rounds, ["greedy", "sampled"])
    assert abs(summary["adaptive"]["all"].vs_baseline - 8.0) < 1e-9
    assert abs(summary["hf"]["all"].vs_baseline - 0.5) < 1e-9
    step = StepRecord(tree_size=8, accepted=2, t_grow=0.01, t_verify=0.09, predicted_t_verify=0.1,
                      predicted_t_grow=0.01)
    errors = prediction_errors([_run(3, 0.1, 1, [step])])
    assert abs(errors["step"] - 0.1) < 1e-3
    goals = goal_checks("disk", summary, methods, errors, 0.9)
    assert goals["disk_greedy_vs_autoregressive"]["value"] == 8.0 and goals["disk_greedy_vs_autoregressive"]["passed"]
    assert goals["greedy_tokens_per_pass"]["value"] == 5.0 and goals["greedy_tokens_per_pass"]["passed"] is False
    assert goals["disk_vs_accelerate_offload"]["value"] == 16.0 and goals["disk_vs_accelerate_offload"]["passed"]
    assert goals["adaptive_vs_best_fixed"]["value"] == 2.0
    assert goals["learned_selection_vs_all_minions"]["value"] == 2.0
    assert goals["autoregressive_stream_efficiency"]["passed"]
    assert goals["step_time_prediction_error"]["passed"]
    assert goals["vs_llama_cpp"] == {"value": 0.8, "goal": None, "passed": None, "applies": True,
                                     "best_llama_cpp": "llama.cpp"}
    assert goals["autoregressive_read_hidden_fraction"]["applies"] is False  # no bound measured: reads assumed
    ram = goal_checks("ram", summary, methods, errors, None)
    assert ram["disk_greedy_vs_autoregressive"]["passed"] is None  # not this tier


def test_the_stream_goal_is_the_figure_the_passes_bound_allows():
    """A compute-bound baseline is not failed on stream efficiency (issue 25: 0.37-0.41
    on an AVX2 EPYC with 98% of the reads hidden); a read-bound one is."""
    methods = [_M("autoregressive", "autoregressive"), _M("adaptive", "adaptive")]
    summary = summarize([{"autoregressive": _run(10, 1.0, 10), "adaptive": _run(10, 0.5, 4)}], ["greedy"])
    compute = stream_bound(bytes_per_pass=212e6, seconds_per_pass=0.090, waiting_per_pass=0.0007, raw_gbps=6.0)
    goals = goal_checks("disk", summary, methods, {"step": None}, 0.39, compute)
    efficiency, hidden = goals["autoregressive_stream_efficiency"], goals["autoregressive_read_hidden_fraction"]
    assert efficiency["applies"] is False and efficiency["passed"] is None
    assert hidden["applies"] and hidden["passed"] and hidden["value"] == 0.98
    assert "compute-bound" in hidden["bound"]
    read = stream_bound(bytes_per_pass=212e6, seconds_per_pass=0.160, waiting_per_pass=0.090, raw_gbps=2.19)
    goals = goal_checks("disk", summary, methods, {"step": None}, 0.6, read)
    efficiency, hidden = goals["autoregressive_stream_efficiency"], goals["autoregressive_read_hidden_fraction"]
    assert efficiency["applies"] and efficiency["passed"] is False  # 0.6 < 0.8: slow streaming is a failure
    assert hidden["applies"] is False and hidden["passed"] is None


def test_bytes_per_pass_bound_and_stream_efficiency():
    ours, peer = _M("adaptive", "adaptive"), _M("hf", "transformers")
    steps = [StepRecord(tree_size=4, accepted=1, t_grow=0, t_verify=0.1, bytes_streamed=200)] * 3
    assert bytes_per_pass(ours, [_run(6, 1.0, 3, steps)], "disk") == 200  # its own stream count
    assert bytes_per_pass(peer, [_run(6, 1.0, 3, read_bytes=900)], "disk") == 300  # what its process read
    assert bytes_per_pass(peer, [_run(6, 1.0, 3, read_bytes=900)], "ram") == 1000  # its weights, from RAM
    assert physical_bound(3.0, 2.0, 10**9) == 6.0 and physical_bound(3.0, None, 10**9) is None
    eff = stream_efficiency([_run(4, 2.0, 4, streamed_bytes=2 * 10**9)], 2.0)
    assert eff == {"achieved_gbps": 1.0, "raw_read_gbps": 2.0, "efficiency": 0.5}


def test_time_split_says_how_fast_the_same_trees_would_go_if_growing_were_free():
    steps = [StepRecord(tree_size=8, accepted=3, t_grow=0.05, t_verify=0.1)] * 4
    split = time_split([_run(16, 1.0, 4, steps)])  # 0.2 s of its 1.0 s grew trees
    assert split["grow"] == 0.2 and split["ms_per_pass"] == 150.0 and split["mean_tree"] == 8.0
    assert split["tok_s_growing_free"] == 20.0  # 16 tokens in the 0.8 s left
    assert time_split([_run(4, 1.0, 4)])["tok_s_growing_free"] == 4.0  # nothing grew: its own speed


def test_calibration_keeps_each_methods_fastest_candidate():
    slow, fast = _M("ar", "autoregressive", 2.0, "fp32", 1), _M("ar", "autoregressive", 1.0, "bf16", 2)
    broken, working = _M("llama", "llama.cpp", 0.1, "q4_1", fail=True), _M("llama", "llama.cpp", 3.0, "f16")
    dead = [_M("dead", "llama.cpp", fail=True), _M("dead", "llama.cpp", fail=True)]
    chosen, table = calibrate([[slow, fast], [broken, working], dead], [1], 4, 2, lambda msg: None)
    assert chosen == [fast, working]  # a group whose every candidate failed is left out
    assert table["ar"] == {"fp32/1t": 500.0, "bf16/2t": 250.0} and table["llama"] == {"f16/1t": 750.0}
    assert broken.calls == 1  # a failed candidate is not tried again


def test_rounds_rotate_and_drop_a_failing_peer():
    class P:
        source, ids = "p", [1]

    ar, ok, bad = _M("autoregressive", "autoregressive"), _M("ok", "fixed"), _M("bad", "llama.cpp", fail=True)
    failures: list[str] = []
    rounds, modes = interleaved([ar, ok, bad], [P(), P()], ["greedy", "sampled"], 4, lambda msg: None, failures)
    assert modes == ["greedy", "sampled"] * 2 and len(rounds) == 4
    assert bad.calls == 1 and len(failures) == 1 and "bad" in failures[0]
    assert all(set(r) == {"autoregressive", "ok"} for r in rounds)
    summary = summarize(rounds, modes)
    assert "bad" not in summary and summary["ok"]["all"].vs_baseline == 1.0


def test_memory_group_refused_where_there_is_no_controller(tmp_path):
    with pytest.raises(NoMemoryGroup, match="no cgroup v1 memory controller"):
        MemoryGroup.create("x", root=tmp_path)


@pytest.mark.skipif(not os.access(ROOT, os.W_OK) or not (ROOT / "memory.limit_in_bytes").is_file(),
                    reason="needs root and a writable cgroup v1 memory controller")
def test_memory_group_holds_a_child_under_its_limit_and_goes_away():
    group = MemoryGroup.create(f"minions-bench-test-{os.getpid()}")
    child = subprocess.Popen(["sleep", "30"])
    try:
        group.add(child.pid)
        assert str(child.pid) in (group.path / "cgroup.procs").read_text().split()
        group.set_limit(64 << 20)
        assert group.limit == 64 << 20 and group.usage <= group.limit
        assert not group.oom_killed()
    finally:
        child.kill()
        child.wait()
        group.remove()
    assert not group.path.exists()


def test_a_cpu_without_bf16_kernels_also_tries_our_baseline_in_bf16_math(monkeypatch):
    """Where our engine widens streamed bf16 weights to float32 math, the autoregressive
    baseline must still get bf16 math (a 1-token pass is faster in it), or its ratios flatter us."""
    import argparse

    from benchmarks import choices

    def dtypes(profile: str, native: bool) -> list[str]:
        monkeypatch.setattr(choices, "cpu_has_bf16_matmul", lambda: native)
        args = argparse.Namespace(tiny=False, quick=True, prompts=None, max_new=None, threads=None, dtypes=None,
                                  fixed=None, profile=profile)
        return choices.settings(args)["dtypes"]

    assert dtypes("cpu-demo-disk", native=False) == ["bf16", "bf16:bf16", "fp32"]
    assert dtypes("cpu-demo-disk", native=True) == ["bf16", "fp32"]
    assert dtypes("rtx4090-70b", native=False) == ["bf16", "fp32"]  # a GPU computes bf16 natively
    from benchmarks.lineup import weights_and_math
    assert weights_and_math("bf16:bf16") == ("bf16", "bf16") and weights_and_math("fp32") == ("fp32", "auto")
