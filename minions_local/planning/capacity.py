"""How many requests decode at once: as many as their caches fit.

The weights are shared; what each more request costs is its slot (core/slots.py): the
target's KV cache over the whole context window, and each minion's own per-request
state. Two estimates of that meet here and a batch takes the smaller:

- the memory plan's, from a profile's budgets before any weights load
  (`MemoryPlan.requests_that_fit`: the caches' tier, less everything placed on it);
- the loaded models' own, against the memory free now (`slots_that_fit`).

Both count with `requests_that_fit`, so a request is sized one way wherever it is sized.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from minions_local.core.protocols import Minion, Target

if TYPE_CHECKING:
    from minions_local.planning.memory_plan import MemoryPlan

SLOT_SHARE = 0.5
"""Of the memory free at load, the share a batch's per-request caches may plan for:
the rest is headroom (activations, a long prompt's chunk, the page cache a streamed
target reads around)."""

CPU_REQUESTS, GPU_REQUESTS = 8, 16
"""The most requests a batch runs at once by default, however much memory is free."""


def requests_that_fit(room: int, per_request: int, *, placed: int = 0) -> int:
    """`placed` requests whose caches are counted already, plus as many more as `room`
    bytes hold; never fewer than one, since a batch always runs the request it has."""
    more = max(0, room // per_request) if per_request else 0
    return max(1, placed + more)


def slot_bytes(target: Target, minions: Sequence[Minion], context_length: int) -> int:
    """What one more concurrent request can come to hold in the loaded models: the
    target's KV cache over the whole context window, plus each minion's per-request
    state (its own cache)."""
    per_token = target.kv_bytes_per_token() if hasattr(target, "kv_bytes_per_token") else 0
    total = per_token * context_length
    for m in minions:
        if hasattr(m, "slot_bytes"):
            total += m.slot_bytes()
        elif hasattr(getattr(m, "runner", None), "kv_bytes_per_token"):
            total += m.runner.kv_bytes_per_token() * context_length
    return total


def slots_that_fit(target: Target, minions: Sequence[Minion], context_length: int, free: int | None = None) -> int:
    """Concurrent requests whose caches fit in SLOT_SHARE of `free` bytes (default: the
    memory free now on the target's device)."""
    free = free_bytes(target.device) if free is None else free
    return requests_that_fit(int(free * SLOT_SHARE), slot_bytes(target, minions, context_length))


def requests_at_once(target: Target, minions: Sequence[Minion], context_length: int,
                     plan: MemoryPlan | None = None) -> int:
    """Requests a batch runs at once by default: what the plan (when the engine has one)
    and the memory free now both leave room for, at most CPU_REQUESTS or GPU_REQUESTS."""
    cap = CPU_REQUESTS if target.device.type == "cpu" else GPU_REQUESTS
    planned = plan.requests_that_fit if plan is not None else cap
    return min(cap, planned, slots_that_fit(target, minions, context_length))


def free_bytes(device) -> int:
    """Memory free on `device` now (a CPU: MemAvailable)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    from minions_local.offload.streamed import available_ram

    return available_ram()
