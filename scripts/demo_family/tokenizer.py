"""The demo family's shared tokenizer: GPT-2 style byte-level BPE.

GPT-2 style (ByteLevel pre-tokenizer with its regex, no normalizer, no prefix space)
because llama.cpp reproduces HF tokenization exactly for the "gpt-2" pre-tokenizer
(PLATFORM_FACTS.md), so the family can be exported to GGUF minions later.

Chat format: role markers are ordinary text ("### User:" / "### Assistant:") rather
than special tokens, because base models trained on code + docs already know what a
markdown heading is; the corpus shows a share of documents in exactly this format.
``<|endoftext|>`` separates documents in training, so it is both BOS (the template
starts with it) and EOS (an assistant turn ends with it).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}### User:\n{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'assistant' %}### Assistant:\n{{ message['content'] }}{{ eos_token }}\n\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The template above in plain Python (without the leading BOS), used to build the
    corpus before any tokenizer exists; a test checks both agree."""
    out = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "system":
            out.append(f"{content}\n\n")
        elif role == "user":
            out.append(f"### User:\n{content}\n\n")
        elif role == "assistant":
            out.append(f"### Assistant:\n{content}{END_OF_TEXT}\n\n")
    if add_generation_prompt:
        out.append("### Assistant:\n")
    return "".join(out)


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train the BPE model. Deterministic for a fixed input order."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(iter(texts), trainer=trainer)
    return tokenizer


def as_hf_tokenizer(tokenizer: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                                 unk_token=END_OF_TEXT, pad_token=END_OF_TEXT, model_max_length=model_max_length,
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf

