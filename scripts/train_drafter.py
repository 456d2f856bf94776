"""Train the feature drafter shipped for SmolLM2-135M-Instruct on the target's own replies.

    python scripts/train_drafter.py data     # the target answers 1000 chat requests (~10 min, 2 cores)
    python scripts/train_drafter.py train    # its features, then the drafter (~25 min)
    python scripts/train_drafter.py eval     # does it pay? against the profile's minions
    python scripts/train_drafter.py all      # all three; writes the drafter into the user cache
    python scripts/train_drafter.py all --device cuda --samples 8 --batch 512   # on a GPU

The drafter (minions_local/backends/eagle.py) is one layer that reads the target's
final hidden states; only its layer, norm and input projection are trained and
written (~/.cache/minions-local/models/smollm2-135m-instruct-eagle.safetensors, where
an 'eagle' minion without a path looks), the embeddings and head are the target's. Prints held-out top-1
agreement with the target on greedy and sampled replies, then one JSON line.
Data goes to ~/.cache/minions-local/drafter-data ($MINIONS_DRAFTER_DATA).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from drafter.prompts import training_prompts  # noqa: E402
from drafter.replies import generate_replies, load_target  # noqa: E402

DATA = Path(os.environ.get("MINIONS_DRAFTER_DATA", Path.home() / ".cache" / "minions-local" / "drafter-data"))


def bench_messages() -> tuple[str, ...]:
    from benchmarks.chat_prompts import CALIBRATION_PROMPT, CHAT_PROMPTS
    return tuple(text for _, text in CHAT_PROMPTS) + (CALIBRATION_PROMPT[1],)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("data", "train", "eval", "all"))
    parser.add_argument("--prompts", type=int, default=1000, help="distinct training requests")
    parser.add_argument("--samples", type=int, default=1,
                        help="replies per request (1: half greedy, half T=0.7; more: one greedy, the rest T=0.7)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (a GPU makes 10x the data in minutes)")
    parser.add_argument("--batch", type=int, default=64, help="replies generated at once")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per training step")
    parser.add_argument("--data", type=Path, default=DATA, help="folder for replies.jsonl and features.pt")
    parser.add_argument("--out", type=Path, default=None,
                        help="the drafter's weights file (default: the user cache, where 'eagle' looks)")
    parser.add_argument("--profile", default="cpu-demo-disk", help="eval: the profile whose tier and minions "
                        "the drafter is compared on")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.data.mkdir(parents=True, exist_ok=True)
    summary: dict = {}
    if args.step in ("data", "all"):
        model, tokenizer = load_target(args.device)
        prompts = training_prompts(args.prompts, seed=args.seed, exclude=bench_messages())
        print(f"the target answers {len(prompts)} training requests x {args.samples} into {args.data}", flush=True)
        generate_replies(model, tokenizer, prompts, args.data / "replies.jsonl", samples=args.samples,
                         batch=args.batch)
        del model
    if args.step in ("train", "all"):
        from drafter.training import train_and_release
        summary |= train_and_release(args.data / "replies.jsonl", args.data / "features.pt", seed=args.seed,
                                     epochs=args.epochs, out=args.out, device=args.device,
                                     batch_tokens=args.batch_tokens)
    if args.step in ("eval", "all"):
        from drafter.evaluation import compare
        from minions_local.models.drafter import trained_path
        print(f"does it pay? {args.profile}, 3 chat requests x 96 tokens", flush=True)
        summary["eval"] = compare(args.profile, args.out or trained_path())
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
