"""Tiny random causal LMs built inside the tests (nothing is downloaded).

`make_family` saves a target, a minion strongly correlated with it (the target's
weights plus small noise, optionally fewer layers) and an unrelated minion, so that
deep multi-token acceptance and rejections both really happen.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedTokenizerFast,
                          Qwen2Config)

CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}


def tiny_config(arch: str, *, vocab: int = 96, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, ctx: int = 256):
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=ctx,
                  bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    if arch == "mistral":
        kwargs["sliding_window"] = None
    return CONFIGS[arch](**kwargs)


def random_model(config, seed: int, scale: float = 1.0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if scale != 1.0:
        with torch.no_grad():
            # Sharper logits make greedy choices stable and acceptance meaningful.
            model.lm_head.weight.mul_(scale)
    return model.eval()


def noisy_copy(model, seed: int, noise: float, layers: int | None = None):
    """The target with a little weight noise (and optionally only its first layers)."""
    config = model.config.__class__(**model.config.to_dict())
    if layers is not None:
        config.num_hidden_layers = layers
        if hasattr(config, "layer_types") and config.layer_types is not None:
            config.layer_types = config.layer_types[:layers]
    copy = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = model.state_dict()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in copy.named_parameters():
            src = state[name]
            p.copy_(src + noise * src.std() * torch.randn(src.shape, generator=gen))
    return copy


def save(model, path: Path, tokenizer=None) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def make_family(root: Path, arch: str = "llama", *, minion_arch: str | None = None, seed: int = 0,
                vocab: int = 96, tokenizer=None) -> dict[str, Path]:
    target = random_model(tiny_config(arch, vocab=vocab, layers=3), seed, scale=25.0)
    close = noisy_copy(target, seed + 1, noise=0.05)
    shallow = noisy_copy(target, seed + 2, noise=0.02, layers=2)
    other = random_model(tiny_config(minion_arch or arch, vocab=vocab, hidden=32, layers=1), seed + 3, scale=25.0)
    return {
        "target": save(target, root / f"{arch}-target", tokenizer),
        "close": save(close, root / f"{arch}-close", tokenizer),
        "shallow": save(shallow, root / f"{arch}-shallow", tokenizer),
        "other": save(other, root / f"{arch}-other", tokenizer),
    }


def tiny_tokenizer(vocab: int = 96) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few lines, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # No full byte alphabet: the vocabulary must fit the tiny models (encode only text
    # made of the training characters).
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False)
    text = ["def add(a, b):\n    return a + b\n", "hello world, hello minions\n"] * 20
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    assert len(fast) <= vocab
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    return fast


EOS = 2  # tiny_tokenizer's </s>


def hf_greedy(model, prompt: list[int], n: int, eos: int | None = EOS) -> list[int]:
    """transformers' own greedy decoding: the reference every speculative run must equal."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=eos)
    return out[0, len(prompt):].tolist()


def feature_drafter_file(target, path, *, copy_layer: bool, seed: int = 0):
    """Weights for `target`: with copy_layer, fc passes the token embedding through
    and the layer is the target's first, so a one-layer target's drafter guesses
    nearly what it would say; else random."""
    from minions_local.models import drafter

    d = target.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    fc = torch.randn(d, 2 * d, generator=g) * 0.05
    if copy_layer:
        fc = torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1)
    layer = {f"{drafter.LAYER_PREFIX}{k}": v.clone() for k, v in target.model.layers[0].state_dict().items()}
    if not copy_layer:
        layer = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in layer.items()}
    tensors = {"fc.weight": fc, "model.norm.weight": target.model.norm.weight.detach().clone(), **layer}
    return drafter.write_weights(tensors, {"test": True}, path)
