"""What llama.cpp says when it refuses a GGUF model, in our words: `--plan` and the load
name an architecture this llama.cpp does not know (backends/llama_context.llama_cpp_refusal
asks llama.cpp before any weights load)."""

from __future__ import annotations

import re
from pathlib import Path


def unknown_architecture(said: str) -> str | None:
    """The architecture named in llama.cpp's refusal, when that is its reason."""
    found = re.search(r"unknown model architecture: '([^']*)'", said)
    return found[1] if found else None


def unknown_architecture_message(path: str | Path, architecture: str) -> str:
    return (f"llama.cpp cannot run {path}: its architecture '{architecture}' is not one this llama.cpp "
            f"knows. Use a GGUF of an architecture it supports (Llama, Qwen, Mistral, Gemma, Phi, ...); a model "
            f"newer than this llama.cpp needs a newer llama-cpp-python.")
