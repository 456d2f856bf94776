"""A streamed target with a real model's shape and random weights, for timing only.

No checkpoint is read: the resident parts are random, and every streamed decoder layer
streams from ONE random packed layer held in (pinned) RAM. The bytes moved per pass
and the compute per layer are those of the real model; the outputs mean nothing. This
is how scripts/gpu_check.py's curve measures a 70B-shaped target on a GPU box without
140 GB of weights on disk.

Layers kept resident (`resident=R`: the first R) all bind ONE packed copy on the
compute device: a 70B layer (0.45 GB in int4, 1.7 GB in bf16) is far larger than any
GPU's L2 cache, so each layer still reads its weights from device memory as a layer
of its own would, and 80 bf16 layers' timing fits on a card that could not hold them.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from minions_local.offload.binding import DequantScratch, ResidentPackedLayer, install_streaming
from minions_local.offload.dtypes import dtype_from_name
from minions_local.offload.layer_store import RamSource, StreamStats
from minions_local.offload.layout import LayerLayout, aligned_empty, plan_layout
from minions_local.offload.skeleton import rebuild_meta_buffers

SHAPES = {
    "llama-70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                      vocab_size=128256, num_hidden_layers=80),
    "demo": dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=8,
                 vocab_size=4096, num_hidden_layers=6),
}


class SyntheticStack:
    """The random parts of one synthetic target, made once; `model(resident)` builds a
    fresh model over them, so a sweep over resident layer counts pays for the random
    weights (seconds for a 70B shape) only once."""

    def __init__(self, shape: str, *, layers: int | None = None, quant: str = "int4",
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as load_streamed_causal_lm pins it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.quant, self.dtype = quant, dtype
        dims = dict(SHAPES[shape])
        if layers is not None:
            dims["num_hidden_layers"] = layers
        self.config = LlamaConfig(**dims, max_position_embeddings=8192, tie_word_embeddings=False)
        self.layers = dims["num_hidden_layers"]
        # Random numbers are drawn where they will live: on a GPU, gigabytes of them take
        # milliseconds there and tens of seconds on the host's cores.
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        skeleton = self._skeleton()
        self.resident_parts = {name: _random(tuple(p.shape), dtype, self.gen, self.device)
                               for name, p in skeleton.named_parameters() if not name.startswith("model.layers.")}
        shapes = {rel: tuple(p.shape) for rel, p in skeleton.model.layers[0].named_parameters()}
        self.layout = plan_layout(shapes, quant, dtype)
        self.data = aligned_empty(self.layout.padded_nbytes, pin=self.device.type == "cuda")
        _fill_random(self.layout, self.data, self.gen, self.device)
        self._on_device: torch.Tensor | None = None

    @property
    def layer_bytes(self) -> int:
        return self.layout.nbytes

    def model(self, resident: int = 0, *, buffers: int = 2,
              readers: int | None = None) -> tuple[nn.Module, StreamStats]:
        """A model whose first `resident` decoder layers stay on the compute device and
        the rest stream from the one packed layer in RAM."""
        if not 0 <= resident <= self.layers:
            raise ValueError(f"resident={resident}: the stack has {self.layers} layers")
        model = self._skeleton()
        for name, value in self.resident_parts.items():
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = nn.Parameter(value, requires_grad=False)
        rebuild_meta_buffers(model, None, "model.layers", self.device)
        decoder = list(model.model.layers)
        scratch = DequantScratch([self.layout], self.quant, self.dtype, self.device)
        for layer in decoder[:resident]:
            ResidentPackedLayer.from_packed(layer, self.layout, self.device_copy(), scratch)
        streamed = decoder[resident:]
        stats = StreamStats(bytes_per_pass=self.layout.nbytes * len(streamed))
        if streamed:
            install_streaming(model, streamed, [RamSource(self.layout, self.data) for _ in streamed],
                              scratch=scratch, device=self.device, dtype=self.dtype, buffers=buffers,
                              readers=readers, stats=stats)
        model.eval()
        return model, stats

    def device_copy(self) -> torch.Tensor:
        """The packed layer on the compute device, shared by every resident layer."""
        if self._on_device is None:
            self._on_device = self.data.to(self.device) if self.device.type != "cpu" else self.data
        return self._on_device

    def _skeleton(self) -> nn.Module:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.config, dtype=self.dtype, attn_implementation="sdpa")


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    if len(shape) == 1:  # norm weights
        return torch.ones(shape, dtype=dtype, device=device)
    return (torch.randn(shape, generator=gen, device=device) * 0.02).to(dtype)


def _fill_random(layout: LayerLayout, data: torch.Tensor, gen: torch.Generator, device: torch.device) -> None:
    """Random integers, small scales, unit norms: finite activations through many layers."""
    for piece in layout.pieces:
        view = piece.view(data)
        if piece.role == "q":
            raw = data[piece.offset : piece.offset + piece.nbytes]
            raw.copy_(torch.randint(0, 256, (piece.nbytes,), generator=gen, dtype=torch.uint8, device=device))
        elif piece.role == "scale":
            view.fill_(0.02 / 7)
        else:
            view.copy_(_random(piece.shape, dtype_from_name(piece.dtype), gen, device))
