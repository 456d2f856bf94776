"""The benchmarks' machinery, behind the scripts/bench*.py entry points.

bench.py's chat benchmark against other systems: `choices` (what a run measures),
`chat_prompts` (its own chat requests), `lineup` (the methods built from a profile),
`methods` (each behind one `run()`), `llama_child` and `memlimit` (llama.cpp in a
child process, in a memory group smaller than the model on the disk tier), `rounds`
(calibrated, interleaved), `report` (ratios, bounds, goals, table, plot) and
`standins` (tiny random models for --tiny). Its modes, pieces measured apart:
`engine_checks` (our engine against itself; `prompts`, held-out third-party code, serves
its `acceptance`) and `gguf_dequant` (the GGUF target's dequantization).
bench_batch.py's: `batch_methods` (batched against one at a time) and `batch_peers`
(transformers' padded batch, llama.cpp's batch API).
bench_stream.py's: `streaming` (timed passes and streamed bytes), `raw_reads` (the
O_DIRECT yardstick, bench.py's and autotune's too) and `stream_bound` (whether reads or
compute bound a pass, so which figure it may claim; bench.py's goal line too).
`synthetic` (a real model's shape with random weights) serves gpu_check's curve.
"""
