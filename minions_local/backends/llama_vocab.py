"""A llama.cpp target's tokenizer, from the GGUF's own vocabulary and chat template.

The engine speaks to tokenizers as transformers' do (encode, decode, the chat template,
BOS/EOS); this gives llama.cpp's vocabulary that surface, so a GGUF of any architecture
llama.cpp loads tokenizes exactly as llama.cpp does, with nothing converted and nothing
written to disk. The chat template is the file's `tokenizer.chat_template`, rendered by
transformers' own renderer, as a transformers tokenizer would render it.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

RENDERER = "transformers.utils.chat_template_utils"


class LlamaVocab:
    """Tokenization and chat prompts through llama.cpp's vocabulary of a loaded model."""

    def __init__(self, lib: Any, model: Any) -> None:
        self.lib = lib
        self.vocab = lib.llama_model_get_vocab(model)
        template = lib.llama_model_chat_template(model, None)
        self.chat_template: str | None = template.decode("utf-8", "replace") if template else None
        bos, eos = int(lib.llama_vocab_bos(self.vocab)), int(lib.llama_vocab_eos(self.vocab))
        self.bos_token_id = bos if bos >= 0 else None
        self.eos_token_id = eos if eos >= 0 else None
        self.add_bos = bool(lib.llama_vocab_get_add_bos(self.vocab))
        self.bos_token = self._text(bos) if bos >= 0 else ""
        self.eos_token = self._text(eos) if eos >= 0 else ""

    def __len__(self) -> int:
        return int(self.lib.llama_vocab_n_tokens(self.vocab))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it (a template's markers) are
        parsed as themselves. `add_special_tokens`: a BOS first where the model wants one."""
        data = text.encode("utf-8")
        n_max = len(data) + 8
        while True:
            buf = (ctypes.c_int32 * n_max)()
            n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, n_max,
                                        add_special_tokens and self.add_bos, True)
            if n >= 0:
                return list(buf[:n])
            n_max = -n

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids` (special tokens left out where `skip_special_tokens`)."""
        if not ids:
            return ""
        tokens = (ctypes.c_int32 * len(ids))(*ids)
        size = 8 * len(ids) + 16
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self.lib.llama_detokenize(self.vocab, tokens, len(ids), buf, size, skip_special_tokens,
                                          not skip_special_tokens)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", "replace")
            size = -n

    def prepare_renderer(self) -> threading.Thread | None:
        """Start importing the template renderer in the background, when the engine is
        ready. Importing it imports transformers: 0.74 s of a first chat's first token
        (2-core AVX-512 EPYC), otherwise paid while a user types. A chat that starts at
        once waits on the import's lock; it pays no more than before."""
        if not self.chat_template or RENDERER in sys.modules:
            return None
        thread = threading.Thread(target=_import_quietly, args=(RENDERER,), name="chat-template-import", daemon=True)
        thread.start()
        return thread

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str | list[int]:
        from transformers.utils.chat_template_utils import render_jinja_template

        if not self.chat_template:
            raise ValueError("this model's GGUF has no chat template")
        rendered = render_jinja_template([messages], chat_template=self.chat_template,
                                         add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                                         eos_token=self.eos_token)
        text = rendered[0][0] if isinstance(rendered, tuple) else rendered[0]
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id (as a GGUF stores it: a BPE vocabulary's byte-level strings)."""
        return {self._raw(i): i for i in range(len(self))}

    def base_vocab(self) -> dict[str, int]:
        """The model's own vocabulary, token text -> id: its normal, byte and control tokens
        (what transformers' vocabulary `with_added_tokens=False` holds), without user-defined
        tokens added on top nor a padded vocabulary's unused ids."""
        lib = self.lib
        trained = lib.LLAMA_TOKEN_ATTR_NORMAL | lib.LLAMA_TOKEN_ATTR_BYTE | lib.LLAMA_TOKEN_ATTR_CONTROL
        return {self._raw(i): i for i in range(len(self)) if self.lib.llama_vocab_get_attr(self.vocab, i) & trained}

    def _raw(self, token: int) -> str:
        text = self.lib.llama_vocab_get_text(self.vocab, token)
        return text.decode("utf-8", "replace") if text else ""

    def _text(self, token: int) -> str:
        buf = ctypes.create_string_buffer(256)
        n = self.lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[:max(n, 0)].decode("utf-8", "replace")


def _import_quietly(name: str) -> None:
    """Import `name`; a failure is left for the chat's own import to report."""
    try:
        __import__(name)
    except Exception:  # noqa: BLE001 - the same import in apply_chat_template raises it to the caller
        pass
