"""Heterogeneous minions with learned weighting vs the best single minion vs equal votes.

    python scripts/bench_mix.py [--quick] [--tier disk|ram] [--threads 1]

SPIN's claim, on our demo family: a mix of an HF bf16 minion, a GGUF q8_0 minion and
the n-gram minion, whose vote weights and participation are learned online, beats
the best of them alone. Same engine, same target tier, same budget policy; only the
minions and the selection mode differ. Workloads: held-out third-party code, and a
multi-turn chat whose later turns repeat earlier text (where the n-gram minion
shines). Methods are interleaved per prompt and compared by ratios in the same run;
ends with one JSON line. Goal (issue 8): learned mix >= 1.15x the best single (disk).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.choices import DEMO
from benchmarks.prompts import held_out_prompts
from minions_local import Engine
from minions_local.engine.from_profile import engine_kwargs_from_profile


def chat_workload(snippets: list[str]) -> list[list[dict[str, str]]]:
    """Conversations whose second user turn quotes the first: text worth looking up."""
    convs = []
    for code in snippets:
        convs.append([
            {"role": "user", "content": f"Here is a function:\n{code}\nExplain it."},
            {"role": "assistant", "content": "It is a helper. Here it is again with comments:\n" + code},
            {"role": "user", "content": "Now write it once more, unchanged:\n" + code[: len(code) // 2]},
        ])
    return convs


def build_engines(tier: str, gguf_path: Path | None) -> dict[str, Engine]:
    base = engine_kwargs_from_profile("stdlib-demo-disk" if tier == "disk" else "stdlib-demo")
    hf = str(DEMO / "minion-qwen2-xs")
    singles: dict[str, list] = {"single hf qwen2-xs": [hf], "single ngram": ["ngram"]}
    mix = [hf, "ngram"]
    if gguf_path is not None:
        singles["single gguf llama-s q8_0"] = [str(gguf_path)]
        mix = [hf, str(gguf_path), "ngram"]
    engines = {}
    for label, minions in singles.items():
        engines[label] = Engine.from_pretrained(**{**base, "minions": minions, "memory_plan": None})
    for mode in ("learned", "equal"):
        engines[f"mix {mode}"] = Engine.from_pretrained(**{**base, "minions": mix, "selection": mode,
                                                           "memory_plan": None})
    return engines


def export_gguf_minion(folder: Path) -> Path | None:
    try:
        from minions_local.backends.gguf_export import export_gguf
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama_cpp not installed: the mix runs without the GGUF minion", file=sys.stderr)
        return None
    out = folder / "minion-llama-s-q8_0.gguf"
    export_gguf(DEMO / "minion-llama-s", out, type="q8_0")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 prompts + 1 chat, 48 tokens each")
    parser.add_argument("--tier", choices=("disk", "ram"), default="disk")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is faster for these small models on a busy 2-core box)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n_prompts, n_tokens = (2, 48) if args.quick else (6, 96)

    with tempfile.TemporaryDirectory() as tmp:
        engines = build_engines(args.tier, export_gguf_minion(Path(tmp)))
        tokenizer = next(iter(engines.values())).tokenizer
        prompts = held_out_prompts(tokenizer, n_prompts, prompt_tokens=150)
        chats = chat_workload([p.text for p in prompts[: max(1, n_prompts // 2)]])
        totals = {label: {"tokens": 0, "seconds": 0.0, "passes": 0} for label in engines}
        workloads = [("code", p.ids) for p in prompts] + [("chat", c) for c in chats]
        for round_no, (kind, work) in enumerate(workloads):
            order = list(engines.items())
            order = order[round_no % len(order):] + order[: round_no % len(order)]  # rotate: fair to all
            for label, engine in order:
                engine.reset()
                run = engine.chat if kind == "chat" else engine.generate
                t0 = time.perf_counter()
                out = run(work, max_new_tokens=n_tokens)
                t = totals[label]
                t["seconds"] += time.perf_counter() - t0 - out.prefill_seconds
                t["tokens"] += len(out.token_ids)
                t["passes"] += len(out.steps)

    speed = {label: t["tokens"] / t["seconds"] for label, t in totals.items()}
    singles = {k: v for k, v in speed.items() if k.startswith("single")}
    best_single = max(singles, key=singles.get)
    print(f"{'method':28} {'tok/s':>8} {'tok/pass':>9} {'vs best single':>15}")
    for label, t in totals.items():
        print(f"{label:28} {speed[label]:8.1f} {t['tokens'] / t['passes']:9.2f} "
              f"{speed[label] / singles[best_single]:14.2f}x")
    result = {
        "tier": args.tier, "threads": args.threads, "quick": args.quick,
        "tokens_per_second": speed,
        "tokens_per_pass": {k: t["tokens"] / t["passes"] for k, t in totals.items()},
        "best_single": best_single,
        "learned_vs_best_single": speed["mix learned"] / singles[best_single],
        "learned_vs_equal": speed["mix learned"] / speed["mix equal"],
    }
    result["goal_learned_mix_1_15x"] = result["learned_vs_best_single"] >= 1.15
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
