"""A GGUF target whose decoder layers stream as their own quantized blocks.

Same machinery as an HF target (streamed.py): a transformers skeleton on the meta
device (its config from the GGUF's metadata, models/gguf_target.py), resident
embeddings, final norm and head, and per decoder layer one packed buffer moved by the
LayerStore with prefetch. What differs is the buffer: it holds the layer's GGUF
tensors, the file's bytes re-packed in planes (offload/gguf_planar.py: the same
bytes of information in the same number of bytes; layout quant 'gguf', each piece's
role its block type), so a pass streams ~5 bits a weight for Q4_1 instead of bf16's
16, and binding.py dequantizes each piece into the compute dtype right before the
layer runs. A Llama's q and k rows, which llama.cpp's converter
permutes, are put back in transformers' order as the pack is written (whole rows of
blocks move, so the bytes stay the file's).

On a CPU (`kernel` 'auto'), a file whose layer matrices are all 4-bit (Q4_0, Q4_1,
Q4_K) stores them instead in the form torch's packed int4 kernel multiplies
(offload/gguf_int4.py: its integers and a bfloat16 (scale, zero) plane, 20 bytes per
32 weights), and the compact forward multiplies them with no dequantization at all;
only the norms are bound as parameters. That form is CPU-specific, so its packs sit in
a folder of their own and record the kernel's layout.

Tiers: 'disk' reads pack files made of those bytes (O_DIRECT, like every pack),
'ram' keeps the same bytes in host memory (pinned for CUDA), 'device' dequantizes the
layer once into ordinary parameters. The embeddings and head are dequantized once
into the compute dtype: they are read every pass, so a resident dequantized copy
costs memory, not time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from minions_local.core.errors import MemoryPlanError, ModelLoadError
from minions_local.core.events import LoadProgress
from minions_local.models.gguf_target import RESIDENT_TENSORS, GGUFTarget, ensure_side_folder, hf_rows, open_target
from minions_local.offload.binding import DequantScratch, install_streaming
from minions_local.offload.checkpoint import folder_key
from minions_local.offload.disk import PackReader
from minions_local.offload.dtypes import compute_dtype, dtype_name
from minions_local.offload import gguf_int4
from minions_local.offload.gguf_blocks import block_type, dequantize
from minions_local.offload.gguf_planar import to_planar
from minions_local.offload.layer_store import DiskSource, RamSource, StreamStats
from minions_local.offload.layout import PIECE_ALIGN, LayerLayout, Piece, aligned_empty, round_up, storage_order
from minions_local.offload.skeleton import decoder_layers, rebuild_meta_buffers, skeleton_model
from minions_local.offload.streamed import PackProgress, fit_memory, layer_tiers_for, open_or_write_packs, read_mode

PACK_FORMAT = "gguf-2"
"""Part of a GGUF pack's fingerprint: bump it when what a pack holds changes."""


def load_streamed_gguf(
    path: str | os.PathLike,
    *,
    tier: str = "disk",
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    layer_tiers: Sequence[str] | None = None,
    buffers: int = 2,
    cache_dir: str | os.PathLike | None = None,
    progress: Callable[[LoadProgress], None] | None = None,
    readers: int | None = None,
    attn_implementation: str | None = "sdpa",
    quant: str = "gguf",
    kernel: str = "auto",
    runs_int4: Callable[[nn.Module], bool] | None = None,
) -> tuple[nn.Module, StreamStats]:
    """Load the GGUF at `path` as a causal LM whose decoder layers stream as GGUF blocks.

    Arguments as `load_streamed_causal_lm`'s; `dtype` is the compute dtype (default
    float32: the GGUF's weights exactly); `quant` must be 'gguf' (the file's own blocks).
    `kernel` (gguf_int4.KERNELS): how streamed 4-bit tensors are multiplied; 'auto'
    takes the int4 kernel where it runs (a CPU, a model the compact forward runs),
    which rounds their scales to bfloat16 (gguf_int4.py says what that changes).
    `runs_int4(model)`: whether the forward that will run the model multiplies int4
    weights (the engine passes backends.compact.supports); None: it does."""
    if quant not in ("gguf", "none"):
        raise ModelLoadError(f"a GGUF target streams its own blocks; quant {quant!r} does not apply to it "
                             f"(leave the profile's streamed quantization at 'none').")
    if buffers < 1:
        raise MemoryPlanError(f"buffers={buffers}: streaming needs at least one layer buffer.")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if dtype is None else _compute_dtype(dtype)
    target = open_target(path)
    folder = ensure_side_folder(target, progress)
    model = skeleton_model(folder, dtype, attn_implementation)
    layers, prefix = decoder_layers(model)
    plans = [_layer_plan(target, i, layer) for i, layer in enumerate(layers)]
    _check_no_unused(target, plans)
    tiers = layer_tiers_for(layer_tiers, tier, len(layers))
    int4 = _uses_int4(kernel, model, device, tiers, plans, runs_int4)
    if int4:  # a resident layer keeps its packed bytes too: every layer computes alike
        tiers = ["ram" if t == "device" else t for t in tiers]
    stats = StreamStats()
    report = PackProgress(progress)
    layouts = [_layout(plan, dtype, int4) for plan in plans]
    with open(target.path, "rb") as file:
        _load_resident(model, target, file, device, dtype)
        tiers = fit_memory(tiers, layouts, device, buffers, stats)
        report.total = sum(lay.nbytes for lay in layouts)
        packs = _ensure_packs(target, file, plans, layouts, tiers, cache_dir, report, int4) if "disk" in tiers else {}
        scratch = DequantScratch(layouts, "gguf", dtype, device)
        sources, streamed = [], []
        try:
            for i, layer in enumerate(layers):
                if tiers[i] == "disk":
                    sources.append(DiskSource(layouts[i], PackReader(packs[i])))
                elif tiers[i] == "ram":
                    sources.append(RamSource(layouts[i], _payload(target, file, plans[i], layouts[i],
                                                                  pin=device.type == "cuda")))
                else:
                    _load_resident_layer(layer, target, file, plans[i], device, dtype)
                if tiers[i] != "device":
                    streamed.append(i)
                if tiers[i] != "disk":
                    report.layer(i, tiers[i], layouts[i].nbytes)
            stats.bytes_per_pass = sum(s.layout.nbytes for s in sources)
            for i in streamed:
                stats.bytes_by_tier[tiers[i]] = stats.bytes_by_tier.get(tiers[i], 0) + layouts[i].nbytes
            stats.read_mode = read_mode(sources, stats)
        except BaseException:
            for s in sources:
                s.close()
            raise
    _drop_page_cache(target.path)
    if sources:
        install_streaming(model, [layers[i] for i in streamed], sources, scratch=scratch, device=device,
                          dtype=dtype, buffers=buffers, readers=readers, stats=stats)
    model.eval()
    model.requires_grad_(False)
    return model, stats


def _compute_dtype(dtype: torch.dtype | str) -> torch.dtype:
    try:
        return compute_dtype(dtype)
    except ValueError as err:
        raise ModelLoadError(str(err)) from None


# -- what each layer holds ------------------------------------------------------------


class _Tensor:
    """One layer parameter's GGUF tensor: where its bytes are, and how they are stored."""

    def __init__(self, target: GGUFTarget, name: str, param: str, shape: tuple[int, ...]) -> None:
        info = target.file.tensors[name]
        try:
            self.btype = block_type(info.ggml_type)
        except ValueError:
            raise ModelLoadError(f"{target.path}: tensor {name} is stored as {info.type_name}, which the GGUF target "
                                 f"cannot stream; supported types: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, F16, "
                                 f"BF16, F32. Re-quantize the file to one of them (llama-quantize).") from None
        if info.shape != shape:
            raise ModelLoadError(f"{target.path}: tensor {name} has shape {info.shape} but the metadata's "
                                 f"config makes it {shape}; the file is inconsistent.")
        self.name, self.param, self.offset, self.nbytes = name, param, info.offset, info.nbytes
        self.shape = shape
        order = target.row_order(param)
        self.rows = None if order is None else torch.tensor(hf_rows(*order))

    @property
    def stored_shape(self) -> tuple[int, ...]:
        row = self.btype.row_bytes(self.shape[-1])
        return (row,) if len(self.shape) == 1 else (self.nbytes // row, row)

    def read(self, file) -> torch.Tensor:
        """The tensor's bytes, rows in transformers' order, shaped `stored_shape`."""
        raw = torch.empty(self.nbytes, dtype=torch.uint8)
        got = os.preadv(file.fileno(), [memoryview(raw.numpy())], self.offset)
        if got != self.nbytes:
            raise ModelLoadError(f"{file.name}: tensor {self.name} ends past the end of the file (truncated).")
        raw = raw.view(self.stored_shape)
        return raw if self.rows is None else raw[self.rows]


def _layer_plan(target: GGUFTarget, i: int, layer: nn.Module) -> list[_Tensor]:
    names = target.layer_tensors(i)
    plan = []
    for param, p in sorted(layer.named_parameters(), key=lambda kv: storage_order(kv[0])):
        if param not in names:
            raise ModelLoadError(f"{target.path} lacks the tensor for layer {i}'s {param}; the file does not "
                                 f"match its own metadata (a partial or damaged export).")
        plan.append(_Tensor(target, names[param], param, tuple(p.shape)))
    return plan


def _check_no_unused(target: GGUFTarget, plans: list[list[_Tensor]]) -> None:
    used = {t.name for plan in plans for t in plan} | set(RESIDENT_TENSORS)
    unused = sorted(n for n in target.file.tensors if n not in used)
    if unused:
        raise ModelLoadError(f"{target.path} holds tensors the {target.file.architecture} model has no place for "
                             f"({', '.join(unused[:4])}{', ...' if len(unused) > 4 else ''}): an architecture "
                             f"variant the GGUF target does not support. Use the model's HF folder.")


def _uses_int4(kernel: str, model: nn.Module, device: torch.device, tiers: list[str],
               plans: list[list[_Tensor]], runs_int4: Callable[[nn.Module], bool] | None) -> bool:
    """Whether streamed 4-bit tensors go through the int4 kernel (see load_streamed_gguf)."""
    if kernel not in gguf_int4.KERNELS:
        raise ModelLoadError(f"gguf_kernel {kernel!r} is not one of {', '.join(gguf_int4.KERNELS)}.")
    if kernel == "dequant" or all(t == "device" for t in tiers):
        return False
    runs = gguf_int4.available(device) and (runs_int4 is None or runs_int4(model))
    if kernel == "int4" and not runs:
        raise ModelLoadError(f"gguf_kernel = 'int4' needs a CPU (this target computes on {device}) and a "
                             f"Llama-family model the compact forward runs ({model.config.model_type}); "
                             f"use gguf_kernel = 'auto' or 'dequant'.")
    others = sorted({t.btype.name for plan in plans for t in plan
                     if len(t.shape) == 2 and not gguf_int4.applies(t.btype.name, t.shape)})
    if others and kernel == "int4":
        raise ModelLoadError(f"gguf_kernel = 'int4' needs every layer matrix in a 4-bit type "
                             f"({', '.join(gguf_int4.INT4_TYPES)}); this file also has {', '.join(others)}. "
                             f"Use gguf_kernel = 'auto' or 'dequant'.")
    # A layer mixing the two would need its float32 matmuls row-invariant too (they are
    # not on a CPU, hf_target._int4_target): such files stay on dequantization.
    return runs and not others


def _layout(plan: list[_Tensor], dtype: torch.dtype, int4: bool = False) -> LayerLayout:
    """Each tensor as one piece of planar blocks, or (`int4`, a 4-bit matrix) as the
    int4 kernel's packed integers and its (scale, zero) plane."""
    pieces, offset = [], 0
    for t in plan:
        if int4 and gguf_int4.applies(t.btype.name, t.shape):
            ints, sz = gguf_int4.piece_shapes(t.shape)
            stored = [Piece(t.param, "int4", 0, ints, "uint8"), Piece(t.param, "int4_sz", 0, sz, "bfloat16")]
        else:
            stored = [Piece(t.param, t.btype.name, 0, t.stored_shape, "uint8")]
        for piece in stored:
            pieces.append(Piece(piece.param, piece.role, offset, piece.shape, piece.dtype))
            offset = round_up(offset + piece.nbytes, PIECE_ALIGN)
    return LayerLayout(tuple(pieces), "gguf", dtype_name(dtype))


def _payload(target: GGUFTarget, file, plan: list[_Tensor], layout: LayerLayout, *, pin: bool = False,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The packed layer: each tensor's planar bytes at its piece's offset, padding zeroed."""
    if out is None:
        out = aligned_empty(layout.padded_nbytes, pin=pin)
    out.zero_()
    params = layout.params()
    for t in plan:
        roles = params[t.param]
        if "int4" in roles:
            ints, sz = gguf_int4.pack(t.read(file), t.btype.name, t.shape)
            roles["int4"].view(out).copy_(ints)
            roles["int4_sz"].view(out).copy_(sz)
        else:
            (piece,) = roles.values()
            piece.view(out).copy_(to_planar(t.read(file), t.btype, t.shape).view(piece.shape))
    return out


# -- resident parts -------------------------------------------------------------------


def _dequantized(target: GGUFTarget, file, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    t = _Tensor(target, name, RESIDENT_TENSORS[name], target.file.tensors[name].shape)
    return dequantize(t.read(file).reshape(-1).to(device), t.btype, t.shape, dtype=dtype)


def _load_resident(model: nn.Module, target: GGUFTarget, file, device: torch.device, dtype: torch.dtype) -> None:
    for gguf_name, hf_name in RESIDENT_TENSORS.items():
        if gguf_name not in target.file.tensors:
            continue  # a tied head: tied below
        owner, _, attr = hf_name.rpartition(".")
        value = _dequantized(target, file, gguf_name, device, dtype)
        model.get_submodule(owner)._parameters[attr] = nn.Parameter(value, requires_grad=False)
    if "output.weight" not in target.file.tensors:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    rebuild_meta_buffers(model, None, "model.layers", device)


def _load_resident_layer(layer: nn.Module, target: GGUFTarget, file, plan: list[_Tensor], device: torch.device,
                         dtype: torch.dtype) -> None:
    for t in plan:
        value = dequantize(t.read(file).reshape(-1).to(device), t.btype, t.shape, dtype=dtype)
        owner, _, attr = t.param.rpartition(".")
        module = layer.get_submodule(owner) if owner else layer
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)


# -- the disk tier's packs ------------------------------------------------------------


def _ensure_packs(target: GGUFTarget, file, plans: list[list[_Tensor]], layouts: list[LayerLayout],
                  tiers: list[str], cache_dir, report: PackProgress, int4: bool = False) -> dict:
    """Pack files of the disk-tier layers' GGUF bytes, reusing those that are up to date."""
    if cache_dir is None:
        from platformdirs import user_cache_dir

        cache_dir = Path(user_cache_dir("minions-local")) / "packs"
    kind = f"gguf-{layouts[0].dtype}" + ("-int4" if int4 else "")
    pack_dir = Path(cache_dir).expanduser() / folder_key(target.path) / kind
    # The int4 kernel's byte layout depends on the CPU: a pack made on another one is rewritten.
    packer = f"int4-{gguf_int4.layout_tag()}:" if int4 else ""
    fingerprint = f"{PACK_FORMAT}:{packer}{target.file.fingerprint()}"

    def fill(i: int, payload: torch.Tensor) -> None:
        _payload(target, file, plans[i], layouts[i], out=payload[: layouts[i].padded_nbytes])

    return open_or_write_packs(pack_dir, fingerprint, layouts, tiers, report, fill)


def _drop_page_cache(path: Path) -> None:
    """Packing read the whole file once; don't leave it crowding the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
