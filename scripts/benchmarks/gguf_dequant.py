"""bench.py gguf-dequant: what dequantizing a GGUF layer costs, against what its smaller
reads save (a piece of `bench.py --gguf-target`, measured apart).

    python scripts/bench.py gguf-dequant [--gguf FILE] [--threads 1] [--repeats 20] [--passes 3]

1. Per decoder layer of the file (default: the shipped SmolLM2 Q4_1), interleaved, best
   of `--repeats`: our torch dequantization of the layer's planar packs into float32
   (what a streamed pass does before each layer runs, offload/gguf_planar.py), the same
   from the file's own block layout (offload/gguf_blocks.py), the widening of the same weights from
   bf16 (what today's bf16 stream does on a CPU without bf16 kernels), and the `gguf`
   package's numpy reference.
2. Bytes per pass: the GGUF layers against the same layers in bf16.
3. With `--llama-cpp N`: greedy replies (`--tokens` each) to the first N chat prompts,
   ours (the GGUF's weights dequantized exactly, float32) against llama.cpp's on the
   same file: how many are identical, and where the first that differ part, with our
   margin between the two best tokens there (a different kernel flips near-ties).
4. With `--passes N`: N one-token passes of the target streamed from disk as GGUF blocks
   and as bf16 (page cache bypassed), alternating, and the share of a GGUF pass that
   went to dequantization.
5. With `--int4`: a layer's matmuls (its Q4_0/Q4_1 tensors) for 1 and 16 rows, three
   ways: dequantized into float32 then a float32 matmul (what a GGUF pass does now),
   the same weights as bf16 in a bf16 matmul, and torch's packed 4-bit kernel
   (`_weight_int4pack_mm_for_cpu`, bf16 activations; no dequantization at all).
   Reports each one's time, its largest difference from the float32 result, whether a
   row comes out the same alone as among 16 (row invariance: what keeps a batched
   verification lossless), and how many of the file's block scales bf16 cannot hold
   (the kernel takes bf16 scales: those weights move by up to 2^-9 of their size).

Prints a table, then ONE JSON line (bench.py prints it). Timings on a shared 2-core box are noisy: compare
the ratios from one run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from minions_local.models.gguf_target import open_target
from minions_local.offload.gguf_blocks import block_type, dequantize, integers
from minions_local.offload.gguf_planar import dequantize_planar, to_planar


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def layer_tensors(path: Path, layer: int) -> list[tuple[torch.Tensor, str, tuple[int, ...]]]:
    target = open_target(path)
    out = []
    with open(path, "rb") as f:
        for name in target.layer_tensors(layer).values():
            info = target.file.tensors[name]
            f.seek(info.offset)
            raw = torch.frombuffer(bytearray(f.read(info.nbytes)), dtype=torch.uint8)
            out.append((raw, info.type_name, info.shape))
    return out


def per_layer(path: Path, repeats: int) -> dict:
    import gguf

    tensors = layer_tensors(path, 1)
    outs = [torch.empty(shape) for _, _, shape in tensors]
    widened = [torch.empty(shape, dtype=torch.bfloat16) for _, _, shape in tensors]
    arrays = [(raw.numpy(), gguf.GGMLQuantizationType[kind]) for raw, kind, _ in tensors]
    planar = [(to_planar(raw, kind, shape), kind, shape) for raw, kind, shape in tensors]

    def ours():
        for (raw, kind, shape), out in zip(planar, outs):
            dequantize_planar(raw, kind, shape, out=out)

    def file_layout():
        for (raw, kind, shape), out in zip(tensors, outs):
            dequantize(raw, kind, shape, out=out)

    def widen():
        for src, out in zip(widened, outs):
            out.copy_(src)

    def reference():
        for raw, kind in arrays:
            gguf.quants.dequantize(raw, kind)

    rounds = {"ours": [], "file_layout": [], "widen_bf16": [], "reference": []}
    for _ in range(3):  # interleaved rounds: other load hits all of them alike
        rounds["ours"].append(best_ms(ours, repeats))
        rounds["file_layout"].append(best_ms(file_layout, repeats))
        rounds["widen_bf16"].append(best_ms(widen, repeats))
        rounds["reference"].append(best_ms(reference, max(2, repeats // 5)))
    weights = sum(o.numel() for o in outs)
    gguf_bytes = sum(raw.numel() for raw, _, _ in tensors)
    return {"weights": weights, "gguf_bytes": gguf_bytes, "bf16_bytes": 2 * weights,
            **{f"{k}_ms": min(v) for k, v in rounds.items()}}


def passes(path: Path, n: int) -> dict:
    """One-token passes from disk, GGUF blocks vs bf16 (the converted folder), alternating."""
    from minions_local.models.smollm2 import ensure_folder
    from minions_local.offload.gguf_streamed import load_streamed_gguf
    from minions_local.offload.streamed import load_streamed_causal_lm

    cache = Path(tempfile.mkdtemp(prefix="bench-gguf-"))
    g, g_stats = load_streamed_gguf(path, tier="disk", dtype=torch.float32, cache_dir=cache, buffers=8)
    b, b_stats = load_streamed_causal_lm(ensure_folder(), tier="disk", dtype=torch.float32, quant="bf16",
                                         cache_dir=cache, buffers=8)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    times = {"gguf": [], "bf16": []}
    with torch.no_grad():
        for model in (g, b):
            model(ids)  # warm: first reads check the packs
        for _ in range(n):
            for key, model in (("gguf", g), ("bf16", b)):
                t0 = time.perf_counter()
                model(ids[:, :1])
                times[key].append(1e3 * (time.perf_counter() - t0))
    return {"gguf_pass_ms": float(np.median(times["gguf"])), "bf16_pass_ms": float(np.median(times["bf16"])),
            "gguf_bytes_per_pass": g_stats.bytes_per_pass, "bf16_bytes_per_pass": b_stats.bytes_per_pass}


def llama_cpp_agreement(path: Path, prompts: int, tokens: int, threads: int) -> dict:
    """Greedy replies of our GGUF target against llama.cpp's on the same file."""
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    from benchmarks.chat_prompts import CHAT_PROMPTS

    from minions_local.models.gguf_target import ensure_side_folder
    from minions_local.offload.gguf_streamed import load_streamed_gguf

    ours, _ = load_streamed_gguf(path, tier="device", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(ensure_side_folder(open_target(path)))
    llm = Llama(model_path=str(path), n_ctx=1024, n_threads=threads, logits_all=True, verbose=False)
    same, parts = 0, []
    for _kind, text in CHAT_PROMPTS[:prompts]:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = tok(chat, add_special_tokens=False).input_ids
        with torch.no_grad():
            out = ours.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                                output_scores=True, return_dict_in_generate=True)
        mine = out.sequences[0, len(ids):].tolist()
        llm.reset()
        llm.eval(ids)
        theirs = []
        for _ in range(len(mine)):
            theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([theirs[-1]])
        if mine == theirs:
            same += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        top2 = torch.topk(out.scores[at][0].float(), 2).values
        parts.append({"token": at, "our_margin": float(top2[0] - top2[1])})
    return {"prompts": prompts, "tokens": tokens, "identical": same, "differ_at": parts}


def int4_kernel(path: Path, repeats: int) -> dict:
    """Section 5: the layer's 4-bit matmuls through torch's packed int4 kernel."""
    import torch.nn.functional as F

    mm, pack = torch.ops.aten._weight_int4pack_mm_for_cpu, torch.ops.aten._convert_weight_to_int4pack_for_cpu
    tensors = [(raw, kind, shape) for raw, kind, shape in layer_tensors(path, 1) if kind in ("Q4_0", "Q4_1")]
    prepared, inexact, groups = [], 0, 0
    for raw, kind, shape in tensors:
        q, d, m = _q4_fields(raw, kind, shape)  # w = d * q + m, q in 0..15, one (d, m) per 32 weights
        dense = torch.empty(shape)
        dequantize_planar(to_planar(raw, kind, shape), kind, shape, out=dense)
        # The kernel computes (q - 8) * scale + zero: scale d, zero m + 8 d, both bf16.
        sz = torch.stack([d.t(), (m + 8 * d).t()], dim=-1).contiguous().to(torch.bfloat16)
        inexact += int((d.to(torch.bfloat16).float() != d).sum())
        groups += d.numel()
        prepared.append((pack(q.to(torch.int32).contiguous(), 1), sz, dense, dense.to(torch.bfloat16)))
    out = {"tensors": len(prepared), "scales_bf16_cannot_hold": inexact / max(groups, 1)}
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 16):
        xs = [torch.randn(rows, dense.shape[1], generator=gen) for _, _, dense, _ in prepared]

        def dequant_fp32():
            for (packed, sz, dense, _), x in zip(prepared, xs):
                F.linear(x, dense.clone())  # the clone stands in for dequantizing into scratch

        def dense_bf16():
            for (_, _, _, wb), x in zip(prepared, xs):
                F.linear(x.to(torch.bfloat16), wb)

        def int4():
            for (packed, sz, _, _), x in zip(prepared, xs):
                mm(x.to(torch.bfloat16), packed, 32, sz)

        ref = [F.linear(x, dense) for (_, _, dense, _), x in zip(prepared, xs)]
        got = [mm(x.to(torch.bfloat16), packed, 32, sz) for (packed, sz, _, _), x in zip(prepared, xs)]
        alone = [mm(x[:1].to(torch.bfloat16), packed, 32, sz) for (packed, sz, _, _), x in zip(prepared, xs)]
        out[f"rows_{rows}"] = {
            "dequant_fp32_ms": best_ms(dequant_fp32, repeats), "dense_bf16_ms": best_ms(dense_bf16, repeats),
            "int4_bf16_ms": best_ms(int4, repeats),
            "int4_max_rel_diff": max(float((g.float() - r).abs().max() / r.abs().max()) for g, r in zip(got, ref)),
            "int4_row_invariant": all(torch.equal(a[0], g[0]) for a, g in zip(alone, got))}
    return out


def _q4_fields(raw: torch.Tensor, kind: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """A Q4_0/Q4_1 tensor's integers [rows, cols] (0..15) and per-32 d, m [rows, cols / 32]."""
    rows, cols = shape
    blocks = raw.view(-1, block_type(kind).type_size)

    def half(byte: int) -> torch.Tensor:  # the float16 at `byte` of every block
        return blocks[:, byte:byte + 2].contiguous().view(torch.float16).float().view(rows, cols // 32)

    d = half(0)
    m = -8 * d if kind == "Q4_0" else half(2)  # Q4_0 stores q with its offset 8: w = d * (q - 8)
    return integers(raw, kind).view(rows, cols), d, m


def add_parsers(modes) -> None:
    p = modes.add_parser("gguf-dequant", help="a GGUF layer dequantized against bf16 widening; --passes, --int4, "
                         "--llama-cpp N")
    p.add_argument("--gguf", type=Path, default=None, help="default: the shipped SmolLM2 Q4_1")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--passes", type=int, default=0)
    p.add_argument("--llama-cpp", type=int, default=0, metavar="N", help="compare N greedy replies with llama.cpp")
    p.add_argument("--tokens", type=int, default=48, help="tokens per reply for --llama-cpp")
    p.add_argument("--int4", action="store_true", help="time torch's packed 4-bit kernel on a layer's matmuls")
    p.set_defaults(measure=measure)


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    if args.gguf is None:
        from minions_local.models.smollm2 import shipped_gguf

        args.gguf = shipped_gguf()
    n_layers = open_target(args.gguf).layers
    layer = per_layer(args.gguf, args.repeats)
    result = {"file": args.gguf.name, "threads": args.threads, "layers": n_layers, "layer": layer, "cpu": _cpu()}
    print(f"{args.gguf.name}: {n_layers} layers, {args.threads} thread(s), {result['cpu']}")
    print(f"per layer: {layer['weights'] / 1e6:.2f} M weights, {layer['gguf_bytes'] / 1e6:.2f} MB of blocks "
          f"({layer['gguf_bytes'] / layer['bf16_bytes']:.3f} of bf16)")
    for key, what in (("ours", "ours (planar, into float32) "), ("file_layout", "from the file's block layout"),
                      ("widen_bf16", "bf16 widened to float32     "), ("reference", "gguf.quants reference (numpy)")):
        ms = layer[f"{key}_ms"]
        print(f"  {what} {ms:7.2f} ms" + (f"   x{n_layers} = {ms * n_layers:6.1f} ms a pass"
                                           if key in ("ours", "widen_bf16") else ""))
    print(f"  ours / widening {layer['ours_ms'] / layer['widen_bf16_ms']:.2f}x, reference / ours "
          f"{layer['reference_ms'] / layer['ours_ms']:.2f}x")
    if args.passes:
        result["passes"] = p = passes(args.gguf, args.passes)
        p["dequant_share_of_gguf_pass"] = share = layer["ours_ms"] * n_layers / p["gguf_pass_ms"]
        print(f"1-token pass from disk (median of {args.passes}): GGUF {p['gguf_pass_ms']:.1f} ms "
              f"({p['gguf_bytes_per_pass'] / 1e6:.1f} MB), bf16 {p['bf16_pass_ms']:.1f} ms "
              f"({p['bf16_bytes_per_pass'] / 1e6:.1f} MB); GGUF/bf16 {p['gguf_pass_ms'] / p['bf16_pass_ms']:.2f}x; "
              f"dequantization ~{share:.0%} of a GGUF pass")
    if args.llama_cpp:
        result["llama_cpp"] = a = llama_cpp_agreement(args.gguf, args.llama_cpp, args.tokens, args.threads)
        where = ", ".join(f"token {d['token']} (our top-2 margin {d['our_margin']:.3f})" for d in a["differ_at"])
        print(f"greedy replies vs llama.cpp on the same file: {a['identical']} of {a['prompts']} identical "
              f"over {a['tokens']} tokens" + (f"; the others part at {where}" if where else ""))
    if args.int4:
        result["int4"] = k = int4_kernel(args.gguf, args.repeats)
        print(f"a layer's {k['tensors']} Q4 matmuls (scales bf16 cannot hold: {k['scales_bf16_cannot_hold']:.0%}):")
        for rows in (1, 16):
            r = k[f"rows_{rows}"]
            print(f"  {rows:>2} rows: float32 matmuls on the dequantized weights {r['dequant_fp32_ms']:.2f} ms, bf16 dense "
                  f"{r['dense_bf16_ms']:.2f} ms, int4 kernel {r['int4_bf16_ms']:.2f} ms "
                  f"(x{r['dequant_fp32_ms'] / r['int4_bf16_ms']:.1f}); int4 largest difference "
                  f"{r['int4_max_rel_diff']:.1e} of the largest output, row-invariant: {r['int4_row_invariant']}")
    return result


def _cpu() -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "")
    isa = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
    return f"{model} ({isa})"

