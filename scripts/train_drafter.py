"""Train the feature drafter shipped for SmolLM2-135M-Instruct on the target's own replies.

    python scripts/train_drafter.py data     # the target answers 1000 chat requests (~10 min, 2 cores)
    python scripts/train_drafter.py train    # its features, then the drafter (~25 min)
    python scripts/train_drafter.py all      # both; writes the drafter into the user cache

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
    parser.add_argument("step", choices=("data", "train", "all"))
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    DATA.mkdir(parents=True, exist_ok=True)
    if args.step in ("data", "all"):
        model, tokenizer = load_target()
        prompts = training_prompts(args.prompts, seed=args.seed, exclude=bench_messages())
        print(f"the target answers {len(prompts)} training prompts into {DATA / 'replies.jsonl'}")
        generate_replies(model, tokenizer, prompts, DATA / "replies.jsonl", batch=64)
    if args.step in ("train", "all"):
        from drafter.training import train_and_release
        summary = train_and_release(DATA / "replies.jsonl", DATA / "features.pt", seed=args.seed,
                                    epochs=args.epochs)
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
