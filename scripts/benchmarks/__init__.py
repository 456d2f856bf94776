"""The benchmarks' machinery, behind the scripts/bench*.py entry points.

bench.py's comparison with other systems: `choices` (what a run measures), `lineup`
(the methods built from a profile), `methods` (each behind one `run()`), `prompts`
(held-out third-party code), `rounds` (interleaved, calibrated), `report` (ratios,
goals, table, plot) and `standins` (random models in the demo family's shapes).
bench_stream.py's: `streaming` (timed passes and streamed bytes), `raw_reads` (the
O_DIRECT yardstick) and `synthetic` (a real model's shape with random weights).
"""
