"""A streamed target with a real model's shape and random weights, for timing only.

No checkpoint is read: the resident parts are random, and every decoder layer streams
from ONE random packed layer held in (pinned) RAM. The bytes moved per pass and the
compute per layer are those of the real model; the outputs mean nothing. This is how
`scripts/bench_stream.py --synthetic llama-70b` measures the pass-time curve of a
70B-shaped int4 target on a GPU box without 140 GB of weights on disk.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from minions_local.offload.binding import DequantScratch, install_streaming
from minions_local.offload.dtypes import dtype_from_name
from minions_local.offload.layer_store import RamSource, StreamStats
from minions_local.offload.layout import LayerLayout, aligned_empty, plan_layout
from minions_local.offload.skeleton import rebuild_meta_buffers

SHAPES = {
    "llama-70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                      vocab_size=128256, num_hidden_layers=80),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     vocab_size=128256, num_hidden_layers=32),
    "demo": dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=8,
                 vocab_size=4096, num_hidden_layers=6),
}


def synthetic_streamed_causal_lm(shape: str, *, layers: int | None = None, quant: str = "int4",
                                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                                 buffers: int = 2, readers: int | None = None,
                                 seed: int = 0) -> tuple[nn.Module, StreamStats]:
    """A Llama of `shape` (see SHAPES; `layers` overrides the depth) streaming from RAM."""
    device = torch.device(device)
    dims = dict(SHAPES[shape])
    if layers is not None:
        dims["num_hidden_layers"] = layers
    config = LlamaConfig(**dims, max_position_embeddings=8192, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(seed)
    for name, param in list(model.named_parameters()):
        if not name.startswith("model.layers."):
            owner, _, attr = name.rpartition(".")
            value = _random(tuple(param.shape), dtype, gen).to(device)
            model.get_submodule(owner)._parameters[attr] = nn.Parameter(value, requires_grad=False)
    rebuild_meta_buffers(model, None, "model.layers", device)

    decoder = list(model.model.layers)
    layout = plan_layout({rel: tuple(p.shape) for rel, p in decoder[0].named_parameters()}, quant, dtype)
    data = aligned_empty(layout.padded_nbytes, pin=device.type == "cuda")
    _fill_random(layout, data, gen)
    stats = StreamStats(bytes_per_pass=layout.nbytes * len(decoder))
    scratch = DequantScratch([layout], quant, dtype, device)
    install_streaming(model, decoder, [RamSource(layout, data) for _ in decoder], scratch=scratch, device=device,
                      dtype=dtype, buffers=buffers, readers=readers, stats=stats)
    model.eval()
    return model, stats


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:  # norm weights
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen) * 0.02).to(dtype)


def _fill_random(layout: LayerLayout, data: torch.Tensor, gen: torch.Generator) -> None:
    """Random integers, small scales, unit norms: finite activations through many layers."""
    for piece in layout.pieces:
        view = piece.view(data)
        if piece.role == "q":
            raw = data[piece.offset : piece.offset + piece.nbytes]
            raw.copy_(torch.randint(0, 256, (piece.nbytes,), generator=gen, dtype=torch.uint8))
        elif piece.role == "scale":
            view.fill_(0.02 / 7)
        else:
            view.copy_(_random(piece.shape, dtype_from_name(piece.dtype), gen))
