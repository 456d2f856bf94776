"""How many bytes each decoder layer of a GGUF target streams: from the file, or from its quantization mix.

A GGUF target streams its layers as the file's own blocks (offload/gguf_streamed.py,
re-packed in planes of the same size), so a layer costs what its tensors take in the
file. When the file is on this machine its header says exactly; a profile planned on
another machine (a 70B file is rarely on the laptop running `--plan`) names the mix
llama.cpp quantized it with, and the sizes follow from the model's dimensions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from minions_local.core.errors import ModelLoadError, ProfileError
from minions_local.profile.dims import ModelDims

GGUFMix = Literal["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q6_K", "Q4_K_M", "Q5_K_M"]

_BYTES_PER_WEIGHT = {"Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q5_0": 22 / 32, "Q8_0": 34 / 32,
                     "Q4_K": 144 / 256, "Q5_K": 176 / 256, "Q6_K": 210 / 256}
"""A block's bytes over its weights, scales included (ggml's block sizes)."""

_K_MIX_BASE = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
"""llama.cpp's _M mixes: this type, except attn_v and ffn_down in the layers `_more_bits` picks, which are Q6_K."""


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mix_layer_bytes(dims: ModelDims, mix: str) -> list[int]:
    """Each decoder layer's bytes in a GGUF quantized with llama.cpp's `mix` (norms in float32)."""
    norms = 2 * dims.hidden * 4
    matrices = dims.attention_params + dims.mlp_params
    if mix not in _K_MIX_BASE:
        return [int(matrices * _BYTES_PER_WEIGHT[mix]) + norms] * dims.layers
    base, more = _BYTES_PER_WEIGHT[_K_MIX_BASE[mix]], _BYTES_PER_WEIGHT["Q6_K"]
    v = dims.hidden * dims.kv_heads * dims.head_dim
    down = dims.hidden * dims.intermediate
    sizes = []
    for i in range(dims.layers):
        promoted = v + down if _more_bits(i, dims.layers) else 0
        sizes.append(int((matrices - promoted) * base + promoted * more) + norms)
    return sizes


def file_layer_bytes(path: Path, layers: int) -> list[int]:
    """Each decoder layer's bytes in the GGUF model at `path` (its headers only are read,
    every shard's for a split model)."""
    sizes = [0] * layers
    for name, info in _file_tensors(path).items():
        if name.startswith("blk."):
            i = int(name.split(".")[1])
            if i < layers:
                sizes[i] += info.nbytes or 0
    return sizes


def _file_tensors(path: str | Path) -> dict:
    from minions_local.models.gguf_file import read_model

    try:
        return read_model(path).tensors
    except ModelLoadError as err:
        raise ProfileError(str(err)) from None


def gguf_layer_bytes(path: str | None, mix: str | None, dims: ModelDims, *, int4: bool = False) -> list[int]:
    """A GGUF target's layer sizes: from its file when it is here, else from `mix`.

    `int4`: its 4-bit layers may be held in the int4 kernel's form (a CPU, gguf_kernel
    not 'dequant': offload/gguf_int4.py), which takes 20 bytes per 32 weights: Q4_0's
    and Q4_K's layers grow by a ninth. The kernel takes a file only when every layer
    matrix is 4-bit, so a mix with Q6_K tensors (the _M mixes) keeps its size."""
    if path and Path(path).is_file():
        sizes = file_layer_bytes(Path(path), dims.layers)
    elif mix is None:
        raise ProfileError(
            f"the GGUF target {path} is not on this machine, so its layer sizes are unknown: set "
            f"target.gguf_mix to the quantization it was made with ({', '.join(GGUFMix.__args__)}).")
    else:
        sizes = mix_layer_bytes(dims, mix)
    types = int4_types(path, mix) if int4 else None
    return [size * 10 // 9 for size in sizes] if types and types & _GROWS else sizes


def int4_types(path: str | None, mix: str | None) -> set[str] | None:
    """The 4-bit types of a GGUF's layer matrices when every one is 4-bit (what the
    int4 kernel takes: offload/gguf_streamed._uses_int4), else None."""
    if path and Path(path).is_file():
        types = {info.type_name for name, info in _file_tensors(path).items()
                 if name.startswith("blk.") and len(info.shape) == 2}
    else:
        types = {mix} if mix else set()
    return types if types and types <= set(INT4_TYPES) else None


INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
"""The block types torch's int4 kernel computes (4-bit integers, 32-weight groups):
named here, with no torch, for the plan; offload/gguf_int4.py packs them."""
_GROWS = {"Q4_0", "Q4_K"}
"""4-bit types smaller than the int4 kernel's form (18 and 144/8 bytes per 32 weights, against 20)."""


def gguf_outside_layers_bytes(path: str | None, mix: str | None, dims: ModelDims) -> int:
    """Bytes of a GGUF target's tensors outside its decoder layers (embeddings, head, final
    norm) as the file holds them: a llama.cpp target reads them in place. From the file
    when it is here, else its mix's type (llama.cpp's _M mixes keep these at Q6_K)."""
    if path and Path(path).is_file():
        return sum(info.nbytes or 0 for name, info in _file_tensors(path).items() if not name.startswith("blk."))
    per_weight = _BYTES_PER_WEIGHT["Q6_K" if mix in _K_MIX_BASE or mix is None else mix]
    params = dims.embedding_params + (0 if dims.tied_embeddings else dims.head_params)
    return int(params * per_weight) + dims.hidden * 4


def llama_cache_cells(context_tokens: int) -> int:
    """KV cells a llama.cpp target's cache holds for a context window: the window, and room
    for a pass's tree rows and for garbage waiting to be compacted (backends/llama_cells.py),
    which compaction frees once it reaches a quarter of the cache."""
    return context_tokens + max(256, context_tokens // 4)


def llama_sequences(vocab: int) -> int:
    """Sequence ids of a llama.cpp target's context (backends/llama_target.py: a slot's
    each, a tree leaf's each): llama.cpp keeps a vocabulary-wide logits row per sequence,
    so there are as many as keep those rows within 64 MiB, 16 to 256."""
    return int(min(256, max(16, (64 << 20) // (4 * vocab))))


def llama_buffer_bytes(dims: ModelDims, cells: int, rows: int = 512) -> int:
    """What llama.cpp allocates beside the KV cache for a target context of `cells` KV
    cells and passes of `rows` rows (backends/llama_rows.py: 512 over a q8_0 cache): the
    logits rows it keeps per sequence, and the compute buffer its graph planner sizes.
    llama.cpp's own report (tests/backends/test_llama_target.py holds the two together)
    fits that as `rows` activations as wide as the widest point of the graph (the head's
    logits beside two hidden states, or the FFN's two intermediate states beside five)
    and a float16 attention mask of `rows` x `cells`: 8B-shaped with a 49152 vocabulary,
    117.3 MiB reported and 117.4 by this; 768 wide 101.8 and 103.8."""
    output = llama_sequences(dims.vocab) * dims.vocab * 4
    widest = max(dims.vocab + 2 * dims.hidden, 2 * dims.intermediate + 5 * dims.hidden)
    return output + rows * 4 * widest + rows * cells * 2


QUANTIZE_TYPES = (("Q8_0", 8.5), ("Q6_K", 6.6), ("Q5_K_M", 5.7), ("Q4_K_M", 4.8), ("Q3_K_M", 3.9), ("Q2_K", 3.0),
                  ("IQ2_XS", 2.4), ("IQ1_M", 1.8))
"""llama-quantize's usual types, by the bits a weight of a Llama's layer matrices takes in
each (block scales included; the mixes' tensors kept at more bits counted in): what a
file too large for its memory could be re-quantized to."""


def layer_bits_per_weight(path: str | None, mix: str | None, dims: ModelDims) -> float:
    """Bits a weight of a GGUF's decoder layers takes: from its file, else its mix."""
    weights = dims.layers * (dims.attention_params + dims.mlp_params)
    return 8 * sum(gguf_layer_bytes(path, mix, dims)) / weights


def fewer_bits(bits: float) -> tuple[str, float] | None:
    """The llama-quantize type one step below `bits` per weight and its bits, or None below the last."""
    return next(((name, b) for name, b in QUANTIZE_TYPES if b < bits - 0.3), None)
