"""Train the shipped demo model family from the Python standard library.

    python scripts/train_demo_family.py --seed 0          # full run (<= 60 min, 2 cores)
    python scripts/train_demo_family.py --quick --out DIR # smoke test, tiny models

One target (Llama, >= 20M params) and three minions (Llama, Qwen2, Mistral; 1-8M
params) on one shared byte-level BPE tokenizer, written as bf16 HF folders with a
manifest and a model card into ``minions_local/demo_models/``. Prints a table of
parameter counts, held-out losses and minion/target greedy agreement on unseen
third-party code, then one JSON line with the same figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Sleeping, not spinning, OpenMP workers: on a box shared with other jobs a spinning
# 2-thread torch ran 2-3x slower than with this (measured); idle speed is unchanged.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from demo_family import corpus as demo_corpus  # noqa: E402
from demo_family import release as demo_release  # noqa: E402
from demo_family.evaluation import evaluate, print_table  # noqa: E402
from demo_family.spec import FULL, QUICK, check_sizes  # noqa: E402
from demo_family.tokenizer import END_OF_TEXT, as_hf_tokenizer, train_byte_level_bpe  # noqa: E402
from demo_family.training import WindowStream, token_stream, train_family, training_text  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "minions_local" / "demo_models"


def log(message: str) -> None:
    print(message, flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the package's demo_models/)")
    parser.add_argument("--quick", action="store_true", help="tiny models and data: a smoke test")
    parser.add_argument("--threads", type=int, default=2, help="torch threads; results depend on it")
    parser.add_argument(
        "--steps-scale", type=float, default=1.0, help="train every phase this many times longer (default 1: the shipped run)"
    )
    args = parser.parse_args(argv)

    spec = QUICK if args.quick else FULL
    if args.steps_scale != 1.0:
        spec = dataclasses.replace(spec, budget=spec.budget.scaled(args.steps_scale))
    out = args.out or (Path(tempfile.mkdtemp(prefix="demo-family-")) if args.quick else DEFAULT_OUT)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    corpus = demo_corpus.build_stdlib_corpus(max_files=spec.max_train_files)
    texts = [training_text(d) for d in corpus.train]
    log(f"corpus: {len(corpus.train)} train docs, {len(corpus.held_out)} held-out files, "
        f"{sum(len(t) for t in texts) / 1e6:.1f} MB text")
    tokenizer = as_hf_tokenizer(train_byte_level_bpe(texts, spec.vocab_size), model_max_length=spec.target.max_positions)
    random.Random(args.seed).shuffle(texts)  # tokenizer saw sorted order; training sees a seeded order
    train_tokens = token_stream(tokenizer, texts)
    held_out_tokens = token_stream(tokenizer, [d.text + END_OF_TEXT for d in corpus.held_out])
    log(f"tokenizer: vocab {len(tokenizer)}, {train_tokens.numel():,} train tokens, "
        f"{held_out_tokens.numel():,} held-out tokens ({time.monotonic() - started:.0f} s)")

    ids = dict(vocab_size=len(tokenizer), bos_id=tokenizer.bos_token_id, eos_id=tokenizer.eos_token_id)
    target = spec.target.build(**ids)
    minions = {shape.name: shape.build(**ids) for shape in spec.minions}
    params = {"target": sum(p.numel() for p in target.parameters())}
    params.update({n: sum(p.numel() for p in m.parameters()) for n, m in minions.items()})
    log("params: " + ", ".join(f"{n} {p:,}" for n, p in params.items()))
    check_sizes(spec, params)

    stream = WindowStream(train_tokens, spec.budget.seq_len, seed=args.seed)
    train_family(target, minions, stream, spec.budget, log=log)
    train_minutes = (time.monotonic() - started) / 60

    models = {"target": target, **minions}
    third_party = demo_corpus.third_party_sample(spec.eval_files_per_package)
    figures, shipped, code_windows = evaluate(spec, tokenizer, models, held_out_tokens, third_party, log=log)
    print_table(figures, log=log)

    for name, model in models.items():
        demo_release.save_member(model, tokenizer, out / name)
        diff = demo_release.check_reloads(out / name, shipped[name], code_windows[0])
        log(f"saved {out / name}: reloads offline, max |logit diff| {diff:.2e}")
        if diff > 1e-3:
            raise SystemExit(f"{name}: reloaded model differs from the trained one ({diff:.2e})")

    wall_minutes = (time.monotonic() - started) / 60
    recipe = {
        "seed": args.seed,
        "python_version": platform.python_version(),
        "held_out_modulus": demo_corpus.HELD_OUT_MODULUS,
        "train_tokens": train_tokens.numel(),
        "held_out_tokens": held_out_tokens.numel(),
        "vocab_size": len(tokenizer),
        "budget": {**vars(spec.budget), "target_steps": spec.budget.target_steps},
        "wall_minutes": wall_minutes,
        "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}, {args.threads} threads",
        "third_party_packages": ", ".join(sorted({d.source.split('/')[0] for d in third_party})),
        "shapes": {
            s.name: {"architecture": s.family, "layers": s.layers, "hidden": s.hidden}
            for s in (spec.target, *spec.minions)
        },
    }
    command = f"python scripts/train_demo_family.py --seed {args.seed} --threads {args.threads}"
    command += (" --quick" if args.quick else "") + (f" --steps-scale {args.steps_scale}" if args.steps_scale != 1.0 else "")
    demo_release.write_model_card(out, figures, recipe, command)
    manifest = demo_release.write_manifest(out)
    size_mb = manifest["total_bytes"] / 1e6
    if size_mb > spec.size_limit_mb:
        raise SystemExit(f"demo family is {size_mb:.1f} MB, over the {spec.size_limit_mb} MB limit")

    summary = {
        "out": str(out),
        "seed": args.seed,
        "quick": args.quick,
        "train_minutes": round(train_minutes, 2),
        "wall_minutes": round(wall_minutes, 2),
        "total_mb": round(size_mb, 2),
        **figures,
    }
    log(f"done in {wall_minutes:.1f} min, {size_mb:.1f} MB in {out}")
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
