"""A transformers causal LM whose decoder layers stream in for every forward pass.

The model is an ordinary `AutoModelForCausalLM` (Llama, Qwen2, Mistral, anything with
`model.model.layers`), so the engine calls it exactly like a resident one, tree masks,
position ids and DynamicCache included. What differs is where each decoder layer's
weights live (`layer_tiers`: 'device' | 'ram' | 'disk'):

- 'device': ordinary resident parameters (or, when quantized, a resident packed
  buffer dequantized before each use, so the plan never changes the model's outputs);
- 'ram' / 'disk': a packed buffer in host RAM or a pack file; a forward pre-hook
  waits for the layer's fetch (`LayerStore.acquire`), points the layer's parameters
  at views into the compute-side buffer (dequantizing first when quantized), and a
  forward hook points them back at an empty placeholder and frees the buffer
  (offload/binding.py).

Embeddings, the final norm and the lm_head always stay resident.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from minions_local.core.errors import MemoryPlanError, ModelLoadError
from minions_local.core.events import LoadProgress
from minions_local.core.tiers import TIERS
from minions_local.offload.binding import DequantScratch, ResidentPackedLayer, install_streaming
from minions_local.offload.checkpoint import Checkpoint, folder_key
from minions_local.offload.disk import PackReader, check_writable, open_pack, pack_name, write_pack
from minions_local.offload.dtypes import compute_dtype
from minions_local.offload.layer_store import DiskSource, RamSource, StreamStats
from minions_local.offload.layout import LayerLayout, aligned_empty, pack_layer, plan_layout
from minions_local.offload.quant import QUANT_MODES
from minions_local.offload.skeleton import decoder_layers, load_resident_parts, skeleton_model

log = logging.getLogger(__name__)

RAM_MARGIN = 1 << 30
"""RAM left free for KV caches, activations and the rest of the system."""


def load_streamed_causal_lm(
    path: str | os.PathLike,
    *,
    tier: str = "ram",
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    layer_tiers: Sequence[str] | None = None,
    quant: str = "none",
    buffers: int = 2,
    cache_dir: str | os.PathLike | None = None,
    progress: Callable[[LoadProgress], None] | None = None,
    readers: int | None = None,
    attn_implementation: str | None = "sdpa",
) -> tuple[nn.Module, StreamStats]:
    """Load an HF causal LM whose decoder layers stream from RAM or disk.

    Args:
        path: HF model folder (config.json + *.safetensors).
        tier: where decoder layers live when `layer_tiers` is None: 'ram' or 'disk'
            ('device' loads a plain resident model through the same code path).
        dtype: compute dtype (torch dtype or a name such as 'bfloat16' / 'bf16');
            None = the checkpoint's dtype, as from_pretrained(dtype="auto").
        device: compute device, 'cpu' or 'cuda[:n]'.
        layer_tiers: one of 'device' | 'ram' | 'disk' per decoder layer, from the
            memory plan (`MemoryPlan.layer_tiers`); overrides `tier`.
        quant: 'none' | 'int8' | 'int4': how decoder-layer weights are stored and
            moved; dequantized into `dtype` before each layer runs (all layers, also
            resident ones, so outputs do not depend on the plan).
        buffers: K compute-side layer buffers (K-1 layers in flight while one computes).
        cache_dir: folder for the disk tier's layer packs (default: the user cache).
        progress: called with `LoadProgress` while layers are packed and placed.
        readers: reader threads of the disk tier (default: max(2, buffers)); each layer
            is read as this many concurrent range reads, so the disk always has queued
            requests while a finished reader waits to be scheduled. On the shared 2-core
            CPU box, buffers=4 (so 4 readers) kept the disk busiest
            (scripts/bench_stream.py measures it).
        attn_implementation: passed to transformers ('sdpa' like the resident loader;
            'eager' needs additive float masks).

    Returns:
        (model, stats): the model in eval mode, and its live `StreamStats`.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    folder = Path(path)
    dtype = weights_dtype(dtype, folder)
    if quant not in QUANT_MODES:
        raise ModelLoadError(f"unknown quantization {quant!r}; use one of {', '.join(QUANT_MODES)}.")
    if buffers < 1:
        raise MemoryPlanError(f"buffers={buffers}: streaming needs at least one layer buffer.")
    ckpt = Checkpoint(folder)
    model = skeleton_model(folder, dtype, attn_implementation)
    ckpt.check_all_used(model)  # no stored layer may be dropped
    layers, prefix = decoder_layers(model)
    tiers = layer_tiers_for(layer_tiers, tier, len(layers))
    stats = StreamStats()
    report = PackProgress(progress)

    layouts = [_layout(ckpt, prefix, i, layer, quant, dtype) for i, layer in enumerate(layers)]
    load_resident_parts(model, ckpt, prefix, device, dtype)
    tiers = fit_memory(tiers, layouts, device, buffers, stats)
    report.total = sum(lay.nbytes for lay in layouts)
    if "disk" in tiers:
        packs = _ensure_packs(folder, ckpt, prefix, layouts, tiers, cache_dir, report)
    else:
        packs = {}

    scratch = DequantScratch(layouts, quant, dtype, device)
    sources: list[RamSource | DiskSource] = []
    streamed: list[int] = []
    try:
        for i, layer in enumerate(layers):
            source = _place_layer(i, layer, tiers[i], layouts[i], packs, ckpt, prefix, scratch, device, dtype, stats)
            if source is not None:
                sources.append(source)
                streamed.append(i)
            if tiers[i] != "disk":
                report.layer(i, tiers[i], layouts[i].nbytes)
        ckpt.drop_page_cache()
        stats.bytes_per_pass = sum(s.layout.nbytes for s in sources)
        for i in streamed:
            stats.bytes_by_tier[tiers[i]] = stats.bytes_by_tier.get(tiers[i], 0) + layouts[i].nbytes
        stats.read_mode = read_mode(sources, stats)
    except BaseException:
        for s in sources:
            s.close()
        raise
    finally:
        ckpt.close()

    if sources:
        install_streaming(model, [layers[i] for i in streamed], sources, scratch=scratch, device=device,
                          dtype=dtype, buffers=buffers, readers=readers, stats=stats)
    model.eval()
    model.requires_grad_(False)
    return model, stats


def weights_dtype(dtype: torch.dtype | str | None, folder: Path) -> torch.dtype:
    """The dtype a streamed model's weights load in: `dtype` (a dtype or a name), or for
    None the checkpoint's own (float32 when it names no floating dtype)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        from transformers import AutoConfig

        try:
            stored = getattr(AutoConfig.from_pretrained(folder), "dtype", None)
        except (OSError, ValueError):
            stored = None  # Checkpoint() reports the folder problem with a remedy
        if isinstance(stored, str):
            stored = getattr(torch, stored, None)
        return stored if isinstance(stored, torch.dtype) and stored.is_floating_point else torch.float32
    try:
        return compute_dtype(dtype)
    except ValueError as err:
        raise ModelLoadError(str(err)) from None


def _place_layer(i: int, layer: nn.Module, tier: str, layout: LayerLayout, packs: dict, ckpt: Checkpoint,
                 prefix: str, scratch: DequantScratch, device: torch.device, dtype: torch.dtype,
                 stats: StreamStats) -> RamSource | DiskSource | None:
    """Put layer i where its tier says; returns its source when it streams."""
    if tier == "disk":
        return DiskSource(layout, PackReader(packs[i]))
    tensors = {rel: ckpt.get(f"{prefix}.{i}.{rel}") for rel in layout.param_numel()}
    if tier == "ram":
        return RamSource(layout, _pack_in_ram(layout, tensors, device, stats))
    if layout.quant == "none":
        _load_resident_layer(layer, tensors, device, dtype)
    else:
        ResidentPackedLayer(layer, layout, tensors, scratch, device)
    return None


def layer_tiers_for(layer_tiers: Sequence[str] | None, tier: str, n: int) -> list[str]:
    """Each of n layers' tier: the plan's per-layer list, or `tier` for all of them."""
    tiers = list(layer_tiers) if layer_tiers is not None else [tier] * n
    if len(tiers) != n:
        raise MemoryPlanError(f"layer_tiers has {len(tiers)} entries but the model has {n} decoder layers; "
                              "re-run the planner for this model.")
    bad = sorted({t for t in tiers if t not in TIERS})
    if bad:
        raise MemoryPlanError(f"unknown tier(s) {bad}; each layer's tier must be one of {', '.join(TIERS)}.")
    return tiers


def _layout(ckpt: Checkpoint, prefix: str, i: int, layer: nn.Module, quant: str, dtype: torch.dtype) -> LayerLayout:
    if any(True for _ in layer.buffers()):
        raise ModelLoadError(f"decoder layer {i} holds buffers; streaming supports layers made of parameters "
                             "only (Llama, Qwen2, Mistral).")
    shapes = {}
    for rel, param in layer.named_parameters():
        key = f"{prefix}.{i}.{rel}"
        if key not in ckpt:
            raise ModelLoadError(f"{ckpt.folder} lacks {key}; the checkpoint does not match its config.json.")
        shapes[rel] = ckpt.shape(key)
        if shapes[rel] != tuple(param.shape):
            raise ModelLoadError(f"{key} has shape {shapes[rel]} in the checkpoint but {tuple(param.shape)} "
                                 "in the config.")
    return plan_layout(shapes, quant, dtype)


class PackProgress:
    """Load progress while packs are written and layers placed (a GGUF loader shares it)."""

    def __init__(self, progress: Callable[[LoadProgress], None] | None) -> None:
        self.progress = progress
        self.total = 0
        self.done = 0

    def layer(self, i: int, tier: str, nbytes: int, message: str = "") -> None:
        self.done += nbytes
        if self.progress is not None:
            self.progress(LoadProgress("target", tier, self.done, self.total, message or f"layer {i} -> {tier}"))

    def packing(self, i: int, nbytes: int) -> None:
        if self.progress is not None:
            self.progress(LoadProgress("target", "disk", self.done, self.total, f"packing layer {i} for the disk tier"))


def available_ram() -> int:
    """Memory free now for new allocations (MemAvailable; unknown: no limit)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: trust the plan


def fit_memory(tiers: list[str], layouts: list[LayerLayout], device: torch.device, buffers: int,
                stats: StreamStats) -> list[str]:
    """Demote layers that cannot fit where the plan put them, with a visible warning.

    Called after the resident parts are loaded, so free memory already excludes them.
    """
    tiers = list(tiers)
    buf_bytes = buffers * max((lay.padded_nbytes for lay in layouts), default=0)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] - buf_bytes - RAM_MARGIN
        tiers = _demote(tiers, layouts, ("device",), "ram", free, "GPU memory", stats)
        buf_bytes = 0
    # On CPU the device tier is RAM too; resident layers get first claim on it.
    host = ("ram",) if device.type == "cuda" else ("device", "ram")
    return _demote(tiers, layouts, host, "disk", available_ram() - buf_bytes - RAM_MARGIN, "RAM", stats)


def _demote(tiers: list[str], layouts: list[LayerLayout], srcs: tuple[str, ...], dst: str, budget: int,
            memory: str, stats: StreamStats) -> list[str]:
    used, moved = 0, []
    for src in srcs:
        for i, t in enumerate(tiers):
            if t != src:
                continue
            if used + layouts[i].nbytes > budget:
                tiers[i] = dst
                moved.append(i)
            else:
                used += layouts[i].nbytes
    if moved:
        msg = (f"{len(moved)} decoder layer(s) planned for {'/'.join(srcs)} do not fit in {memory} "
               f"({max(budget, 0) / 1e9:.2f} GB free); layers {sorted(moved)} stream from '{dst}' "
               "instead, which is slower. Re-plan with the real free memory to avoid this.")
        log.warning(msg)
        stats.warnings.append(msg)
    return tiers


def _ensure_packs(folder: Path, ckpt: Checkpoint, prefix: str, layouts: list[LayerLayout], tiers: list[str],
                  cache_dir, report: PackProgress):
    """Pack files for the disk-tier layers, reusing those that are up to date."""
    if cache_dir is None:
        from platformdirs import user_cache_dir

        cache_dir = Path(user_cache_dir("minions-local")) / "packs"
    pack_dir = Path(cache_dir).expanduser() / folder_key(folder) / f"{layouts[0].dtype}-{layouts[0].quant}"

    def fill(i: int, payload: torch.Tensor) -> None:
        tensors = {rel: ckpt.get(f"{prefix}.{i}.{rel}") for rel in layouts[i].param_numel()}
        pack_layer(layouts[i], tensors, payload)

    return open_or_write_packs(pack_dir, ckpt.fingerprint(), layouts, tiers, report, fill)


def open_or_write_packs(pack_dir: Path, fingerprint: str, layouts: list[LayerLayout], tiers: list[str],
                        report: PackProgress, fill: Callable[[int, torch.Tensor], None]) -> dict:
    """The pack file of every disk-tier layer: the one in `pack_dir` where it is whole
    and of this `fingerprint`, else written anew from what `fill(i, payload)` puts in
    the layer's payload buffer (a checkpoint's tensors, a GGUF file's blocks)."""
    packs, todo = {}, []
    for i, t in enumerate(tiers):
        if t != "disk":
            continue
        pack = open_pack(pack_dir / pack_name(i), layer=i, layout=layouts[i], fingerprint=fingerprint)
        if pack is None:
            todo.append(i)
        else:
            packs[i] = pack
    if todo:
        check_writable(pack_dir, sum(layouts[i].padded_nbytes + 8192 for i in todo))
        payload = aligned_empty(max(layouts[i].padded_nbytes for i in todo))
        for i in todo:
            report.packing(i, layouts[i].nbytes)
            fill(i, payload)
            packs[i] = write_pack(pack_dir / pack_name(i), layer=i, layout=layouts[i], payload=payload,
                                  fingerprint=fingerprint)
    for i in packs:
        report.layer(i, "disk", layouts[i].nbytes, f"layer {i} -> disk ({pack_dir})")
    return packs


def _pack_in_ram(layout: LayerLayout, tensors: dict, device: torch.device, stats: StreamStats) -> torch.Tensor:
    pin = device.type == "cuda"
    try:
        data = aligned_empty(layout.padded_nbytes, pin=pin)
    except RuntimeError as e:
        if not pin:
            raise MemoryPlanError(f"cannot allocate {layout.padded_nbytes / 1e9:.2f} GB of RAM for a layer: {e}") from e
        msg = f"pinned host memory unavailable ({e}); the RAM tier uses pageable memory (slower copies)."
        if msg not in stats.warnings:
            log.warning(msg)
            stats.warnings.append(msg)
        data = aligned_empty(layout.padded_nbytes)
    pack_layer(layout, tensors, data)
    return data


def _load_resident_layer(layer: nn.Module, tensors: dict, device: torch.device, dtype: torch.dtype) -> None:
    for rel, t in tensors.items():
        owner, _, attr = rel.rpartition(".")
        module = layer.get_submodule(owner) if owner else layer
        module._parameters[attr] = nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)


def read_mode(sources: list, stats: StreamStats) -> str:
    """How the disk layers will be read (O_DIRECT or buffered), as the load reports it."""
    disk = [s for s in sources if isinstance(s, DiskSource)]
    if not disk:
        return ""
    probe = aligned_empty(disk[0].layout.padded_nbytes)
    disk[0].reader.read_into(probe)  # also checks layer 0's checksum up front
    if all(s.reader.direct for s in disk):
        return "o_direct"
    msg = ("the disk tier's file system refuses O_DIRECT; reading with posix_fadvise(DONTNEED) instead "
           "(page cache still dropped).")
    log.warning(msg)
    stats.warnings.append(msg)
    return "fadvise"
