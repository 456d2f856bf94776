"""Whether llama.cpp can load a GGUF model, asked before any weights load: `--plan` says
so for a file whose architecture this llama.cpp does not know, as the load would.

llama.cpp keeps its architectures to itself (no list in its API), so it is asked: a
vocabulary-only load (the header and the vocabulary, 0.3 s for an 8B file) in a child
interpreter, whose log is its own. In this process llama.cpp's log callback is the
backends' (backends/llama_context.py), which a second caller must not replace.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

_PROBE = """
import sys, llama_cpp
params = llama_cpp.llama_model_default_params()
params.vocab_only = True
sys.exit(0 if llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params) else 3)
"""


def llama_cpp_refusal(path: str | Path) -> str | None:
    """What llama.cpp says when it cannot load the model at `path`; '' when it can; None
    where it cannot be asked (no llama-cpp-python, or it did not answer)."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, text=True,
                              timeout=120, errors="replace")
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode == 0:
        return ""
    reasons = re.findall(r"error loading model: (.*)", done.stderr)
    return reasons[-1].strip() if done.returncode == 3 and reasons else None


def unknown_architecture(said: str) -> str | None:
    """The architecture named in llama.cpp's refusal, when that is its reason."""
    found = re.search(r"unknown model architecture: '([^']*)'", said)
    return found[1] if found else None


def unknown_architecture_message(path: str | Path, architecture: str) -> str:
    return (f"llama.cpp cannot run {path}: its architecture '{architecture}' is not one this llama.cpp "
            f"knows. Use a GGUF of an architecture it supports (Llama, Qwen, Mistral, Gemma, Phi, ...); a model "
            f"newer than this llama.cpp needs a newer llama-cpp-python.")
