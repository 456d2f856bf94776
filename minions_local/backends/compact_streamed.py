"""The compact forward for a target whose decoder layers stream from RAM or disk.

The layers' weights arrive with every pass (offload/streamed.py, offload/binding.py): before layer i runs,
its fetch is waited for and its parameters point into the layer buffer; afterwards the
buffer goes back to the prefetch pipeline. transformers gets there through module
hooks; this forward runs the same `enter` / `exit` itself around its own fused layer
code. The pack layout stores q/k/v and gate/up back to back (`layout.storage_order`),
so the fused weights are views of the buffer, not copies. Weights change every pass,
so only the resident lm_head is prepacked for oneDNN: the gain over transformers is
the framework overhead (measured on the demo target, one thread: 1-token pass 9.7 -> 8.4 ms,
32 tokens 24.2 -> 20.7 ms, resident weights).
"""

from __future__ import annotations

import torch

from minions_local.offload.binding import layer_store, layer_weights
from minions_local.backends.compact import CompactDecoder, fused_layer
from minions_local.backends.packing import packing_is_exact


class StreamedCompactDecoder(CompactDecoder):
    def __init__(self, model, capacity: int = 512, exact: bool = True, row_invariant: bool = False) -> None:
        self.modules = list(model.model.layers)
        self.weights = [layer_weights(layer) for layer in self.modules]
        """Per layer: what gives it its weights around each pass (None: fused at load)."""
        self.store = layer_store(model)
        self._views: dict[tuple[int, int], dict] = {}
        """(layer, address of its bound q weight) -> its fused views for that buffer."""
        super().__init__(model, capacity=capacity, pack=False, exact=exact, row_invariant=row_invariant)
        if packing_is_exact(self.dtype, self.device):
            self._pack_head()  # the lm_head stays resident: prepack it once

    def _fuse(self, layer) -> dict | None:
        if layer_weights(layer) is not None:
            return None  # its weights arrive with each pass
        return super()._fuse(layer)

    def _layer(self, i: int) -> dict:
        fused = self.layers[i]
        if fused is not None:
            return fused
        layer, weights = self.modules[i], self.weights[i]
        weights.enter()
        att, mlp = layer.self_attn, layer.mlp
        # A layer sitting in a given buffer always binds the same views (the streamer
        # caches its bindings per buffer), so its fused views are built once per buffer.
        key = (i, getattr(weights, "buffer", None), att.q_proj.weight.data_ptr())
        if key in self._views:
            return self._views[key]
        packed = weights.packed_linears() if getattr(weights, "int4", False) else None
        fused = fused_layer(layer, stacked, packed)
        stacks = [(fused["qkv"], att.q_proj.weight), (fused["gate_up"], mlp.gate_proj.weight)]
        if fused["qkv_bias"] is not None:
            stacks.append((fused["qkv_bias"], att.q_proj.bias))
        # A tuple holds int4 weights (views of this buffer) or the layer's own parameters.
        if all(isinstance(whole, tuple) or whole.data_ptr() == first.data_ptr() for whole, first in stacks):
            self._views[key] = fused  # views only: a kept copy would hold the layer resident
        return fused

    def _done(self, i: int) -> None:
        if self.layers[i] is None:
            self.weights[i].exit()

    def _begin_pass(self) -> None:
        if self.store is not None:
            self.store.begin_pass()


def stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) along dim 0, as a view when the parts already lie back to back
    in one storage (a packed layer buffer laid out in storage_order)."""
    first = parts[0]
    expected = first.data_ptr()
    for p in parts:
        if not p.is_contiguous() or p.data_ptr() != expected or p.shape[1:] != first.shape[1:]:
            return torch.cat(parts)
        expected += p.numel() * p.element_size()
    rows = sum(p.shape[0] for p in parts)
    return torch.as_strided(first, (rows, *first.shape[1:]), first.stride(), first.storage_offset())
