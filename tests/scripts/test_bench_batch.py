"""bench_batch.py's machinery on tiny random stand-ins: every method of ours serves the
same requests, greedy replies are compared with serving them one at a time, and the
JSON line has the figures issue 24 asks for."""

import json

from benchmarks.batch_methods import BatchResult, RequestTiming

from minions_local.core.events import StepRecord


def test_bench_batch_tiny_end_to_end(tmp_path, capsys):
    import bench_batch

    assert bench_batch.main(["--tiny", "--no-peers", "--modes", "greedy,sampled", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["concurrency"] == [1, 2] and result["modes"] == ["greedy", "sampled"]
    rows = result["results"]
    for name in ("one-at-a-time", "batched", "batched-no-trees"):
        for n in (1, 2):
            row = rows[f"{name}/{n}/greedy"]
            assert row["aggregate_tok_s"] > 0 and row["identical_to_alone"] == n  # lossless per request
            assert rows[f"{name}/{n}/sampled"]["identical_to_alone"] is None
    assert rows["batched/2/greedy"]["tokens_per_pass"] >= 2  # two requests in each pass
    assert rows["one-at-a-time/2/greedy"]["vs_one_at_a_time"] == 1.0
    assert "lone_request_vs_today" in result["goals"]
    assert (tmp_path / "bench-batch-stdlib-demo-disk.png").is_file()


def test_batch_result_figures():
    steps = [StepRecord(tree_size=3, accepted=2, t_grow=0.0, t_verify=0.1, bytes_streamed=1000, batch_size=2)] * 4
    result = BatchResult([RequestTiming([1, 2, 3, 4, 5], 0.5, 1.5), RequestTiming([1, 2, 3], 0.2, 2.2)], 2.5,
                         steps, streamed_bytes=2000)
    assert result.tokens == 8 and result.aggregate_tokens_per_second == 8 / 2.5
    assert result.passes == 2 and result.tokens_per_pass == 4 and result.bytes_per_pass == 1000
    per = result.per_request()
    assert per["median_tok_s"] == 2.5 and per["p10_tok_s"] == 1.0 and per["median_ttft_s"] == 0.35
