"""The memory planner: which target layers live on the device, in RAM, or on disk.

Pure arithmetic over a profile's budgets and the models' sizes (no torch, no weights),
so `--plan` works for a 70B target on a laptop. The order of claims on device memory:

1. the reserve (CUDA context, activations), the minions and their KV caches, the
   target's KV cache and output head: all needed every step, so they come first;
2. K layer buffers, if any layer streams (the transfer of layer i+1 overlaps the
   compute of layer i);
3. as many target layers as fit stay resident (at the resident quantization);
4. the rest stream (at the streamed quantization) from host RAM while it lasts, then
   from disk.

The embeddings, final norm and head stay on the device, as the streaming runtime
(offload/streamed.py) loads them. On a CPU box the "device" is RAM, and the budgets
are the shares of it the profile grants to each use, or, for a target named on the
command line, the memory this machine has free now (machine_memory.py, fitting.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from minions_local.core.errors import MemoryPlanError
from minions_local.core.tiers import TIERS
from minions_local.planning.capacity import requests_that_fit
from minions_local.planning.machine_memory import MachineMemory
from minions_local.profile.dims import ModelDims, bytes_per_param, dims_for
from minions_local.profile.gguf_sizes import (fewer_bits, gguf_layer_bytes, gguf_outside_layers_bytes, int4_types,
                                              layer_bits_per_weight, llama_buffer_bytes, llama_cache_cells)
from minions_local.profile.schema import MinionSection, Profile

GB = 1e9


@dataclass(frozen=True)
class Placement:
    """One thing the plan puts somewhere."""

    what: str
    tier: str
    bytes: int


@dataclass(frozen=True)
class LayerBuffers:
    """Device-side buffers that streamed layers are copied into, in turn."""

    count: int
    bytes_each: int
    tier: str = "device"


@dataclass(frozen=True)
class MemoryPlan:
    """Where everything goes. `layer_tiers[i]` is 'device', 'ram' or 'disk' for layer i."""

    layer_tiers: list[str]
    layer_bytes: list[int]
    """Stored size of each layer at its tier's quantization."""
    buffers: LayerBuffers
    placements: list[Placement]
    """Everything except the target's layers (minions, KV caches, head, buffers, ...)."""
    budgets: dict[str, int]
    """Bytes each tier may use (device net of the reserve is in placements)."""
    device: str
    target_dims: ModelDims
    minion_bytes: dict[str, int] = field(default_factory=dict)
    """Weight bytes of each minion, by name (0 for the n-gram minion)."""
    minion_dims: dict[str, ModelDims] = field(default_factory=dict)
    embeddings_tier: str = "device"
    name: str = ""
    math_dtype: str = ""
    """What the target computes in, where that is not its weights' dtype ('' = the same)."""
    machine: MachineMemory | None = None
    """Where the device budget came from when it is this machine's free memory, not the profile's."""
    notes: tuple[str, ...] = ()
    """What was chosen for a target named on the command line, and why (planning/fitting.py)."""

    @property
    def resident_layers(self) -> int:
        return self.layer_tiers.count("device")

    @property
    def streamed_bytes_by_tier(self) -> dict[str, int]:
        """Target weight bytes moved into device memory per forward pass, by source tier."""
        out = {"ram": 0, "disk": 0}
        for tier, size in zip(self.layer_tiers, self.layer_bytes):
            if tier != "device":
                out[tier] += size
        return out

    @property
    def streamed_bytes_per_pass(self) -> int:
        return sum(self.streamed_bytes_by_tier.values())

    @property
    def resident_layer_bytes(self) -> int:
        return sum(b for t, b in zip(self.layer_tiers, self.layer_bytes) if t == "device")

    @property
    def target_layer_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def bytes_by_tier(self) -> dict[str, int]:
        """Everything placed on each tier, target layers included."""
        out = dict.fromkeys(TIERS, 0)
        for p in self.placements:
            out[p.tier] += p.bytes
        for tier, size in zip(self.layer_tiers, self.layer_bytes):
            out[tier] += size
        return out

    def format(self) -> str:
        """A human table: each tier's budget, use and contents, then the layer map."""
        used = self.bytes_by_tier
        d = self.target_dims
        lines = [
            f"Memory plan{f' for {self.name}' if self.name else ''} ({self.device}): target "
            f"{d.layers} layers, {_gb(self.target_layer_bytes)} of layers, "
            f"{_gb(self.streamed_bytes_per_pass)} streamed per pass",
        ]
        lines += self.choices()
        lines.append(f"{'tier':<7} {'budget':>9} {'used':>9}  contents")
        for tier in TIERS:
            n_layers = self.layer_tiers.count(tier)
            items = [f"{n_layers} target layers {_gb(self._layer_sum(tier))}"] if n_layers else []
            items += [f"{p.what} {_gb(p.bytes)}" for p in self.placements if p.tier == tier]
            if not items and not self.budgets.get(tier):
                continue
            lines.append(
                f"{tier:<7} {_gb(self.budgets.get(tier, 0)):>9} {_gb(used[tier]):>9}  "
                + (", ".join(items) or "-")
            )
        lines.append("layers: " + " | ".join(_runs(self.layer_tiers)))
        by_tier = self.streamed_bytes_by_tier
        lines.append(
            f"streamed per pass: {_gb(self.streamed_bytes_per_pass)} "
            f"(from RAM {_gb(by_tier['ram'])}, from disk {_gb(by_tier['disk'])}); "
            f"{self.buffers.count} device buffers of {_gb(self.buffers.bytes_each)}"
            if self.streamed_bytes_per_pass
            else "streamed per pass: nothing (the target is resident)"
        )
        fit = (f"requests at once (continuous batching): {_gb(self.kv_per_request)} of KV caches each; "
               f"{self.requests_that_fit} fit")
        if self.resident_layers and self.streamed_bytes_per_pass and self.kv_per_request:
            # Where resident layers fill the device, each one streamed instead frees room for more requests.
            layer = self.resident_layer_bytes // self.resident_layers
            fit += f" (one more takes the room of {-(-self.kv_per_request // layer)} resident layers)"
        lines.append(fit)
        return "\n".join(lines)

    def choices(self) -> list[str]:
        """What was fitted to this machine, a line each: the budget's source, the minions, the context."""
        memory = [f"memory: {self.machine.describe()}; the layers that do not fit stream from the file through "
                  f"the page cache"] if self.machine is not None else []
        return [f"  {line}" for line in memory + list(self.notes)]

    @property
    def kv_per_request(self) -> int:
        """Cache bytes one more concurrent request needs (continuous batching: every
        request has its own KV cache in the target and in each minion, over the whole
        context window and a tree)."""
        return sum(p.bytes for p in self.placements if p.what.startswith("KV cache"))

    @property
    def requests_that_fit(self) -> int:
        """Concurrent requests whose caches fit where the first one's are placed (the
        first is in the plan's tables already)."""
        tier = next((p.tier for p in self.placements if p.what.startswith("KV cache")), "device")
        room = self.budgets.get(tier, 0) - self.bytes_by_tier[tier]
        return requests_that_fit(room, self.kv_per_request, placed=1)

    def _layer_sum(self, tier: str) -> int:
        return sum(b for t, b in zip(self.layer_tiers, self.layer_bytes) if t == tier)


def plan_memory(
    profile: Profile,
    *,
    target_dims: ModelDims | None = None,
    minion_dims: dict[str, ModelDims] | None = None,
    math_dtype: str | None = None,
    machine: MachineMemory | None = None,
) -> MemoryPlan:
    """Place the target's layers, minions, KV caches and buffers within the budgets.

    Dimensions default to each model's config.json, else the profile's known dims.
    math_dtype: what the target computes in when that is not its weights' dtype (bf16
    weights streamed into float32 math): its KV cache, embeddings and head are held in
    it; its layers are stored in the weights' dtype all the same.
    machine: set when the device budget is this machine's free memory (a command-line
    target: planning/fitting.py): the plan says so, and so do its errors.
    Raises MemoryPlanError (with the numbers and what to change) when they cannot fit.
    """
    hw, tgt = profile.hardware, profile.target
    dims = target_dims or dims_for(tgt.path, tgt.dims, "target")
    minion_dims = dict(minion_dims or {})
    kv_tokens = tgt.context_tokens + profile.speculation.max_budget + 1
    cuda = hw.device == "cuda"

    device_fixed: list[Placement] = []
    host_fixed: list[Placement] = []
    minion_bytes: dict[str, int] = {}
    for i, m in enumerate(profile.minions):
        size, kv, mdims = _minion_cost(m, minion_dims.get(m.name), kv_tokens, i)
        if mdims is not None:
            minion_dims[m.name] = mdims
        minion_bytes[m.name] = size
        on_device = (m.device or hw.device) == hw.device
        bucket = device_fixed if on_device else host_fixed
        tier = "device" if on_device else "ram"
        if size:
            bucket.append(Placement(f"minion '{m.name}'", tier, size))
        if kv:
            bucket.append(Placement(f"KV cache '{m.name}'", tier, kv))
    math = math_dtype or tgt.dtype
    llama = tgt.format == "gguf" and gguf_on_llama_cpp(tgt.gguf_kernel, hw.device)
    embeddings_tier = "device"
    if llama:  # llama.cpp reads the file's own tensors in place; its KV cache is float16
        kv_cells = llama_cache_cells(tgt.context_tokens)
        # q8_0 keys and values: 34 bytes a 32 (backends/llama_target.py says why q8_0)
        device_fixed.append(Placement("KV cache target", "device",
                                      kv_cells * dims.kv_bytes_per_token("float16") * 17 // 32))
        device_fixed.append(Placement("llama.cpp buffers (logits, compute)", "device", llama_buffer_bytes(dims, kv_cells)))
        device_fixed.append(Placement("embeddings + head (as in the file)", "device",
                                      gguf_outside_layers_bytes(tgt.path, tgt.gguf_mix, dims)))
    else:
        device_fixed.append(Placement("KV cache target", "device", kv_tokens * dims.kv_bytes_per_token(math)))
        if dims.tied_embeddings:
            device_fixed.append(Placement("embeddings + head (tied)", "device", dims.head_bytes(math)))
        else:
            device_fixed.append(Placement("embeddings", "device", dims.embedding_bytes(math)))
            device_fixed.append(Placement("head", "device", dims.head_bytes(math)))

    budgets = {
        "device": int(hw.device_memory_gb * GB),
        "ram": int(hw.host_ram_gb * GB),
        "disk": int(hw.disk_budget_gb * GB) if tgt.tier == "disk" else 0,
    }
    if hw.device_reserve_gb:
        device_fixed.insert(0, Placement("reserve", "device", int(hw.device_reserve_gb * GB)))

    resident_b = dims.layer_bytes(tgt.resident_quantization, tgt.dtype)
    streamed_b = buffer_b = dims.layer_bytes(tgt.streamed_quantization, tgt.dtype)
    if llama:
        sizes = gguf_layer_bytes(tgt.path, tgt.gguf_mix, dims)
        streamed_b = resident_b = -(-sum(sizes) // len(sizes))
        buffer_b, scratch = max(sizes), 0
    elif tgt.format == "gguf":
        streamed_b, buffer_b, resident_b, scratch = _gguf_layer_costs(tgt, dims, math, hw.device == "cpu")
    n = dims.layers
    cap = n if tgt.resident_layers is None else min(n, tgt.resident_layers)
    fixed = sum(p.bytes for p in device_fixed)

    if cap == n and fixed + n * resident_b <= budgets["device"]:
        tiers = ["device"] * n
        buffers = LayerBuffers(0, 0)
    else:
        if tgt.tier == "device":
            raise MemoryPlanError(_no_room_for_resident(profile, fixed, dims, resident_b, machine))
        buffers = LayerBuffers(tgt.layer_buffers, buffer_b)
        what = f"{buffers.count} streamed layers read ahead" if llama else f"{buffers.count} layer buffers"
        device_fixed.append(Placement(what, "device", buffers.count * buffer_b))
        fixed += buffers.count * buffer_b
        if tgt.format == "gguf" and not llama:
            device_fixed.append(Placement("dequantization scratch (one layer)", "device", scratch))
            fixed += scratch
        if fixed > budgets["device"]:
            raise MemoryPlanError(_no_room_for_minimum(profile, device_fixed, dims, machine))
        resident = min(cap, (budgets["device"] - fixed) // resident_b)
        tiers = _place_streamed(profile, dims, resident, streamed_b, host_fixed, budgets)
        if cuda and "disk" in tiers:
            # Disk reads land in pinned staging buffers before crossing PCIe: make room.
            host_fixed.append(Placement("disk staging buffers", "ram", buffers.count * buffer_b))
            tiers = _place_streamed(profile, dims, resident, streamed_b, host_fixed, budgets)
    layer_bytes = [resident_b if t == "device" else streamed_b for t in tiers]
    plan = MemoryPlan(
        layer_tiers=tiers,
        layer_bytes=layer_bytes,
        buffers=buffers,
        placements=device_fixed + host_fixed,
        budgets=budgets,
        device=hw.device,
        target_dims=dims,
        minion_bytes=minion_bytes,
        minion_dims=minion_dims,
        embeddings_tier=embeddings_tier,
        name=profile.name,
        math_dtype=math_dtype or "",
        machine=machine,
    )
    _check_host(profile, plan)
    return plan


def gguf_on_llama_cpp(kernel: str, device: str) -> bool:
    """Whether a GGUF target computes on llama.cpp (backends/llama_target.py): on a CPU by
    default ('auto', where llama-cpp-python is installed), or when the profile asks
    ('llama.cpp'); 'int4' and 'dequant' are the torch paths (offload/gguf_streamed.py)."""
    if kernel == "llama.cpp":
        return True
    if kernel != "auto" or device != "cpu":
        return False
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def _gguf_layer_costs(tgt, dims: ModelDims, math: str, cpu: bool) -> tuple[int, int, int, int]:
    """A GGUF target's streamed layer (the file's mean layer: its _M mixes vary by
    layer), its layer buffer (the largest layer), its resident layer and its
    dequantization scratch (both a layer in the compute dtype: offload/gguf_streamed.py)."""
    int4 = cpu and tgt.gguf_kernel != "dequant"
    sizes = gguf_layer_bytes(tgt.path, tgt.gguf_mix, dims, int4=int4)
    dense = dims.layer_bytes("none", math)
    # Weights the int4 kernel multiplies as they are need no scratch: only the norms do.
    scratch = 2 * dims.hidden * 4 if int4 and int4_types(tgt.path, tgt.gguf_mix) else dense
    return -(-sum(sizes) // len(sizes)), max(sizes), dense, scratch


def _minion_cost(m: MinionSection, dims: ModelDims | None, kv_tokens: int, index: int):
    """(weight bytes, KV bytes, dims) of one minion; the n-gram minion costs nothing."""
    if m.kind == "ngram":
        return 0, 0, None
    dims = dims or dims_for(m.path, m.dims, f"minions[{index}]")
    if m.kind == "self_draft":  # the target's first layers: its dims, fewer layers
        dims = replace(dims, layers=min(m.layers, dims.layers))
    if m.kind == "eagle":  # one layer of the target's shape and its input projection; embeddings shared
        dims = replace(dims, layers=1)
        size = int((dims.attention_params + dims.mlp_params + 2 * dims.hidden ** 2) * bytes_per_param("none", m.dtype))
        return size, kv_tokens * dims.kv_bytes_per_token(m.dtype), dims
    if m.kind == "gguf" and m.path and Path(m.path).is_file():
        size = Path(m.path).stat().st_size  # the file is exactly what gets loaded
    else:
        matrices = dims.layers * (dims.attention_params + dims.mlp_params)
        size = int(matrices * bytes_per_param(m.quantization, m.dtype))
        size += dims.embedding_bytes(m.dtype) + (0 if dims.tied_embeddings else dims.head_bytes(m.dtype))
    return size, kv_tokens * dims.kv_bytes_per_token(m.dtype), dims


def _place_streamed(profile, dims, resident, streamed_b, host_fixed, budgets) -> list[str]:
    tgt, hw = profile.target, profile.hardware
    n = dims.layers
    remaining = n - resident
    host_free = budgets["ram"] - sum(p.bytes for p in host_fixed)
    n_ram = max(0, min(remaining, host_free // streamed_b)) if host_free > 0 else 0
    n_disk = remaining - n_ram
    if n_disk and tgt.tier == "ram":
        need = remaining * streamed_b + sum(p.bytes for p in host_fixed)
        raise MemoryPlanError(
            f"{profile.name}: {remaining} target layers must stream from RAM "
            f"({_gb(remaining * streamed_b)} at {tgt.streamed_quantization}) but "
            f"hardware.host_ram_gb = {hw.host_ram_gb} leaves room for {n_ram} "
            f"(host RAM needed: {_gb(need)}). Change one of: raise hardware.host_ram_gb to "
            f"{need / GB:.1f}, {_fewer_bytes(tgt, dims)}, or set target.tier = 'disk'."
        )
    if n_disk * streamed_b > budgets["disk"]:
        raise MemoryPlanError(
            f"{profile.name}: {n_disk} target layers must stream from disk "
            f"({_gb(n_disk * streamed_b)}) but hardware.disk_budget_gb = {hw.disk_budget_gb}. "
            f"Raise hardware.disk_budget_gb to at least {n_disk * streamed_b / GB:.1f} "
            f"(free space under {hw.disk_path}), or give the RAM tier more room."
        )
    return ["device"] * resident + ["ram"] * n_ram + ["disk"] * n_disk


def _check_host(profile: Profile, plan: MemoryPlan) -> None:
    used = plan.bytes_by_tier["ram"]
    if used > plan.budgets["ram"]:
        items = ", ".join(f"{p.what} {_gb(p.bytes)}" for p in plan.placements if p.tier == "ram")
        raise MemoryPlanError(
            f"{profile.name}: host RAM needs {_gb(used)} ({items}) but hardware.host_ram_gb = "
            f"{profile.hardware.host_ram_gb}. Raise hardware.host_ram_gb to {used / GB:.1f}, "
            "or run the minions on the compute device."
        )


def _no_room_for_minimum(profile: Profile, fixed: list[Placement], dims: ModelDims,
                         machine: MachineMemory | None) -> str:
    total = sum(p.bytes for p in fixed)
    items = ", ".join(f"{p.what} {_gb(p.bytes)}" for p in fixed)
    tgt = profile.target
    if machine is not None:  # nothing here is the user's to set but the memory and the file
        return (
            f"{tgt.path} needs {_gb(total)} of memory before any of its layers stays resident, with a context "
            f"of {tgt.context_tokens} tokens ({items}), but this machine has {machine.describe()}. Free memory "
            f"(close other programs, or raise the container's memory limit), or {_fewer_bytes(tgt, dims)}."
        )
    return (
        f"{profile.name}: the device needs {_gb(total)} before any target layer stays "
        f"resident ({items}), but hardware.device_memory_gb = {profile.hardware.device_memory_gb}. "
        f"Change one of: raise hardware.device_memory_gb to {total / GB:.1f}; lower "
        f"target.context_tokens (now {tgt.context_tokens}); set target.layer_buffers = 1 "
        f"(now {tgt.layer_buffers}); {_fewer_bytes(tgt, dims)}; quantize "
        "the minions (quantization = 'nf4') or use fewer of them."
    )


def _no_room_for_resident(profile: Profile, fixed: int, dims: ModelDims, layer_b: int,
                          machine: MachineMemory | None) -> str:
    n = dims.layers
    need = fixed + n * layer_b
    if machine is not None:
        return (
            f"{profile.target.path} needs {_gb(need)} to keep all {n} of its layers resident (tier 'device'), "
            f"but this machine has {machine.describe()}. Leave the tier out to stream the layers that do not "
            f"fit from the file, free memory, or {_fewer_bytes(profile.target, dims)}."
        )
    return (
        f"{profile.name}: target.tier = 'device' needs all {n} layers resident: "
        f"{_gb(need)} with everything else, but hardware.device_memory_gb = "
        f"{profile.hardware.device_memory_gb}. Set target.tier = 'ram' (or 'disk') to "
        f"stream layers, or target.resident_quantization = 'int4', or raise "
        f"hardware.device_memory_gb to {need / GB:.1f}."
    )


def _fewer_bytes(tgt, dims: ModelDims) -> str:
    """What would shrink the target's layers: for a GGUF, a type below the file's own."""
    if tgt.format != "gguf":
        return "set target.streamed_quantization = 'int4'"
    bits = layer_bits_per_weight(tgt.path, tgt.gguf_mix, dims)
    smaller = fewer_bits(bits)
    if smaller is None:
        return (f"give it more memory (its layers take {bits:.1f} bits a weight, fewer than llama-quantize's "
                f"usual types)")
    return (f"use a GGUF of fewer bits (its layers take {bits:.1f} bits a weight; a {smaller[0]} takes about "
            f"{smaller[1]:.1f}: llama-quantize it from the original weights)")


def _runs(tiers: list[str]) -> list[str]:
    out, start = [], 0
    for i in range(1, len(tiers) + 1):
        if i == len(tiers) or tiers[i] != tiers[start]:
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            out.append(f"{span} {tiers[start]}")
            start = i
    return out


def _gb(n: int | float) -> str:
    if abs(n) >= 0.995 * GB:
        return f"{n / GB:.1f} GB"
    if abs(n) >= 1e6:
        return f"{n / 1e6:.0f} MB"
    return f"{n / 1e3:.0f} kB" if n else "0"
