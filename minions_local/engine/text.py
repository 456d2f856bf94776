"""Text in and out: tokenizers, chat prompts, incremental detokenization, stop strings.

The decoder only sees token ids; everything about characters lives here.
"""

from __future__ import annotations

from pathlib import Path

from minions_local.core.errors import ModelLoadError


def load_tokenizer(path: Path, role: str):
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer.model", "vocab.json")
    if not any((path / f).is_file() for f in files):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"The tokenizer in {path} ({role}) could not be read: {e}\nRestore the tokenizer "
                             f"files (tokenizer.json, tokenizer_config.json) from the original model.") from None


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    """The prompt text for a conversation, ending where the assistant's reply starts.

    Uses the model's chat template when it has one; otherwise a plain transcript that
    a base model can continue.
    """
    for msg in messages:
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise ValueError(f"each message needs 'role' and 'content', got {msg!r}")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(lines) + "\n\nAssistant:"


class IncrementalText:
    """Turns a growing list of token ids into text deltas.

    Byte-level BPE can split one character over several tokens, so text is only
    released once it no longer ends in a partial character (U+FFFD).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        if self.tokenizer is None:
            return ""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return delta

    def flush(self) -> str:
        if self.tokenizer is None:
            return ""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full
        return delta


def find_stop(text: str, stops: list[str]) -> int:
    """Index where the earliest stop string starts in `text`, or -1."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits, default=-1)
