"""How a decoder layer gets its weights around each call, and where that state lives.

A layer whose weights are packed (streamed from RAM or disk, or resident but
quantized) has empty parameters between calls. Before a call, its parameters point
at views into the packed buffer (dequantized into a scratch buffer first when
quantized); afterwards they point back at an empty placeholder. transformers gets
there through module hooks; the compact forward calls `enter` / `exit` itself.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from minions_local.offload.layer_store import DiskSource, LayerStore, RamSource, StreamStats
from minions_local.offload.layout import LayerLayout, aligned_empty, pack_layer, round_up
from minions_local.offload.gguf_int4 import Int4Weight
from minions_local.offload.gguf_planar import dequantize_planar
from minions_local.offload.quant import dequantize


def install_streaming(model: nn.Module, layers: list[nn.Module], sources: list[RamSource | DiskSource], *,
                      scratch: DequantScratch, device: torch.device, dtype: torch.dtype, buffers: int,
                      readers: int | None, stats: StreamStats) -> LayerStore:
    """Make `layers` (in execution order) take their weights from `sources` on each call."""
    store = LayerStore(sources, device=device, buffers=buffers, stats=stats,
                       readers=readers if readers is not None else max(2, buffers))
    stats.bytes_by_tier["device"] = sum(b.numel() * b.element_size() for b in store.buffers)
    for j, layer in enumerate(layers):
        StreamedLayer(layer, j, store, scratch, dtype, device)
    model.model.register_forward_pre_hook(lambda _m, _a: store.begin_pass())
    weakref.finalize(model, store.close)
    _stores[model] = store  # keeps the pipeline alive with the model
    return store


class DequantScratch:
    """One compute-dtype buffer that quantized layers are dequantized into, one layer at a time."""

    def __init__(self, layouts: list[LayerLayout], quant: str, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        size = 0
        if quant != "none":
            size = max((self.span(lay)[1] for lay in layouts), default=0)
        self.data = torch.empty(size, dtype=dtype, device=device)

    @staticmethod
    def span(layout: LayerLayout) -> tuple[dict[str, int], int]:
        offsets, n = {}, 0
        for name, shape in layout.param_numel().items():
            offsets[name] = n
            numel = 1
            for s in shape:
                numel *= s
            n = round_up(n + numel, 32)
        return offsets, n

    def views(self, layout: LayerLayout) -> dict[str, torch.Tensor]:
        offsets, _ = self.span(layout)
        out = {}
        for name, shape in layout.param_numel().items():
            numel = 1
            for s in shape:
                numel *= s
            out[name] = self.data[offsets[name] : offsets[name] + numel].view(shape)
        return out


@dataclass(slots=True)
class _Binding:
    param: nn.Parameter
    target: torch.Tensor
    q: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    kind: str = ""
    """The GGUF block type of `q` (a layout of quant 'gguf'), or ''."""


def _bindings(params: dict[str, nn.Parameter], layout: LayerLayout, buffer: torch.Tensor,
              scratch: DequantScratch) -> list[_Binding]:
    """How each of a layer's `params` (by name) is produced from a packed `buffer` holding
    it; a weight the int4 kernel multiplies as it is (`packed_linears`) is never bound."""
    quantized = any(p.role != "" for p in layout.pieces)
    scratch_views = scratch.views(layout) if quantized else {}
    out = []
    for name, roles in layout.params().items():
        if "int4" in roles:
            continue
        if layout.quant == "gguf":
            (kind, piece), = roles.items()
            out.append(_Binding(params[name], scratch_views[name], piece.view(buffer), kind=kind))
        elif "" in roles:
            out.append(_Binding(params[name], roles[""].view(buffer)))
        else:
            q, scale = roles["q"].view(buffer), roles["scale"].view(buffer) if "scale" in roles else None
            out.append(_Binding(params[name], scratch_views[name], q, scale))
    return out


def packed_linears(layout: LayerLayout, buffer: torch.Tensor) -> dict[str, Int4Weight]:
    """The weights of a layer in `buffer` that the int4 kernel multiplies as they are,
    by parameter name (views into the buffer; none outside a GGUF int4 pack)."""
    return {name: Int4Weight(roles["int4"].view(buffer), roles["int4_sz"].view(buffer))
            for name, roles in layout.params().items() if "int4" in roles}


def _bind(bindings: list[_Binding], quant: str) -> None:
    for b in bindings:
        if b.kind:
            dequantize_planar(b.q, b.kind, b.target.shape, out=b.target)
        elif b.q is not None:
            dequantize(b.q, b.scale, quant, out=b.target)
        b.param.data = b.target


def _unbind(bindings: list[_Binding], placeholder: torch.Tensor) -> None:
    for b in bindings:
        b.param.data = placeholder


def _empty_parameters(layer: nn.Module, placeholder: torch.Tensor) -> None:
    for module in layer.modules():
        for attr, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[attr] = nn.Parameter(placeholder, requires_grad=False)


class StreamedLayer:
    """Hooks that give a decoder layer its weights from the LayerStore for each call.

    `enter` / `exit` are also what a forward that does not call the module (the
    compact forward) runs around the layer; `layer_weights(layer)` finds them."""

    def __init__(self, layer: nn.Module, j: int, store: LayerStore, scratch: DequantScratch, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.j, self.store, self.scratch = j, store, scratch
        self.layout = store.sources[j].layout
        self.placeholder = torch.empty(0, dtype=dtype, device=device)
        _empty_parameters(layer, self.placeholder)
        self.params = dict(layer.named_parameters())
        """The layer's (emptied) parameters; not the layer itself, which `_weights` keys weakly."""
        self.bindings: dict[int, list[_Binding]] = {}
        """Per buffer index: the views this layer binds when it sits in that buffer."""
        self.current: list[_Binding] = []
        self.linears: dict[int, dict[str, Int4Weight]] = {}
        """Per buffer index: the weights the int4 kernel multiplies in place (`packed_linears`)."""
        self.buffer: int | None = None
        """The buffer the layer sits in while it runs (between `enter` and `exit`)."""
        self.int4 = any(p.role == "int4" for p in self.layout.pieces)
        """Some weights are multiplied in the int4 kernel's form: only a forward that
        asks for them (the compact one) can run this layer."""
        layer.register_forward_pre_hook(lambda _m, _a: self._module_enter())
        layer.register_forward_hook(lambda _m, _a, _o: self.exit())
        _weights[layer] = self

    def _module_enter(self) -> None:
        if self.int4:
            raise RuntimeError("this layer's 4-bit weights are held in the int4 kernel's form, which only the "
                               "compact forward multiplies; load the GGUF target with gguf_kernel='dequant' to "
                               "run transformers' forward on it")
        self.enter()

    def enter(self) -> None:
        """Wait for this layer's fetch and point its parameters into the buffer."""
        k = self.store.acquire(self.j)
        if k not in self.bindings:
            self.bindings[k] = _bindings(self.params, self.layout, self.store.buffers[k], self.scratch)
            self.linears[k] = packed_linears(self.layout, self.store.buffers[k])
        self.current, self.buffer = self.bindings[k], k
        _bind(self.current, self.layout.quant)

    def packed_linears(self) -> dict[str, Int4Weight]:
        """The running layer's int4-kernel weights by parameter name ({} when none)."""
        return self.linears[self.buffer]

    def exit(self) -> None:
        """The layer has run: empty its parameters and give its buffer back."""
        _unbind(self.current, self.placeholder)
        self.buffer = None
        self.store.release(self.j)


class ResidentPackedLayer:
    """A quantized layer kept on the compute device, dequantized before each call."""

    def __init__(self, layer: nn.Module, layout: LayerLayout, tensors: dict, scratch: DequantScratch,
                 device: torch.device) -> None:
        host = aligned_empty(layout.padded_nbytes)
        pack_layer(layout, tensors, host)
        self._bind_packed(layer, layout, host.to(device), scratch)

    @classmethod
    def from_packed(cls, layer: nn.Module, layout: LayerLayout, packed: torch.Tensor,
                    scratch: DequantScratch) -> ResidentPackedLayer:
        """A layer resident in `packed`, a buffer on the compute device already laid out
        by `layout` (a synthetic timing stack lets many layers share one such buffer)."""
        self = cls.__new__(cls)
        self._bind_packed(layer, layout, packed, scratch)
        return self

    def _bind_packed(self, layer: nn.Module, layout: LayerLayout, packed: torch.Tensor,
                     scratch: DequantScratch) -> None:
        device = packed.device
        self.packed = packed
        self.layout = layout
        self.placeholder = torch.empty(0, dtype=scratch.dtype, device=device)
        _empty_parameters(layer, self.placeholder)
        self.bindings = _bindings(dict(layer.named_parameters()), layout, self.packed, scratch)
        layer.register_forward_pre_hook(lambda _m, _a: self.enter())
        layer.register_forward_hook(lambda _m, _a, _o: self.exit())
        _weights[layer] = self

    def enter(self) -> None:
        _bind(self.bindings, self.layout.quant)

    def exit(self) -> None:
        _unbind(self.bindings, self.placeholder)


# What this module keeps for transformers' objects, here and not as attributes set on
# them. Weak keys: an entry lives as long as its model or layer, and no value refers
# back to its key (a layer's hooks hold its weights object, not the other way round).
_weights: weakref.WeakKeyDictionary[nn.Module, StreamedLayer | ResidentPackedLayer] = weakref.WeakKeyDictionary()
_stores: weakref.WeakKeyDictionary[nn.Module, LayerStore] = weakref.WeakKeyDictionary()


def layer_weights(layer: nn.Module) -> StreamedLayer | ResidentPackedLayer | None:
    """What gives this decoder layer its weights around each call (None: its own
    resident parameters)."""
    return _weights.get(layer)


def uses_int4_kernel(model: nn.Module) -> bool:
    """Some streamed layer of `model` holds weights in the int4 kernel's form (only the
    compact forward runs it: offload/gguf_int4.py)."""
    return any(getattr(layer_weights(layer), "int4", False) for layer in model.model.layers)


def layer_store(model: nn.Module) -> LayerStore | None:
    """The prefetch pipeline of a model loaded by `load_streamed_causal_lm` (None: nothing streams)."""
    return _stores.get(model)
