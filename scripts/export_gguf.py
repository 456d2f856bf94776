#!/usr/bin/env python
"""Export one of our HF checkpoints (Llama, Qwen2, Mistral) to a GGUF minion file.

    python scripts/export_gguf.py SRC_HF_DIR OUT.gguf [--type f32|f16|q8_0|q4_0]

f32 needs only the `gguf` package; the other types are made by llama.cpp's quantizer
(llama-cpp-python: scripts/build_llama_cpp_wheel.sh). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from minions_local.backends.gguf_export import export_gguf
from minions_local.core.errors import MinionsError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="Hugging Face model folder (config.json, *.safetensors, tokenizer.json)")
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--type", default="q8_0", choices=["f32", "f16", "q8_0", "q4_0"],
                        help="weight type (default q8_0: the minion sweet spot on CPU)")
    parser.add_argument("--pre-tokenizer", default=None,
                        help="llama.cpp pre-tokenizer name, only for tokenizers that are not GPT-2 style")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        out = export_gguf(args.src, args.out, type=args.type, pre_tokenizer=args.pre_tokenizer)
    except MinionsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    size = out.stat().st_size
    print(f"wrote {out} ({args.type}, {size / 2**20:.1f} MiB) in {seconds:.1f} s")
    print(json.dumps({"out": str(out), "type": args.type, "bytes": size, "seconds": round(seconds, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
