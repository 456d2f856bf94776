"""A GGUF target named on the command line, fitted to this machine, with minions that suit it.

A profile describes one machine and one model: its budgets are what its own target needs,
its minions were chosen for that target. When `--target any.gguf` replaces the target of
a CPU profile (the default one: a newcomer's first command), neither holds:
  - memory: the budget is what this machine has free now (machine_memory.py), all of it
    for the target (on a CPU the "device" is RAM); the layers that do not fit stream from
    the file itself through the page cache (the "disk" tier: backends/llama_stream.py), so
    the disk budget is the file's size and nothing is copied;
  - minions: unless --minion names them, a small model on the target's vocabulary found
    beside it (models/minion_search.py), plus n-gram; the profile's 'substitute' (the
    target re-quantized by llama.cpp, as large as the target in its fewer bits) only for
    a target under 1 GB, where it is small;
  - context: the profile's, at most what the model was trained for, halved (down to 512
    tokens) while its KV cache leaves the plan no room.
Each choice is said (`notes`), in --plan and in the chat's load messages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

from minions_local.core.errors import MemoryPlanError, ModelLoadError
from minions_local.models.gguf_file import read_model
from minions_local.models.llama_probe import unknown_architecture, unknown_architecture_message
from minions_local.models.minion_search import find_minions, size_text
from minions_local.models.vocabulary import check_same_tokens, model_tokens
from minions_local.planning.machine_memory import GB, MachineMemory, usable_memory
from minions_local.planning.memory_plan import MemoryPlan, gguf_on_llama_cpp, plan_memory
from minions_local.profile import MinionSection, ModelDims, Profile, dims_for, load_profile

SUBSTITUTE_BELOW = 1_000_000_000
"""Bytes of a target below which its substitute (about its size in 3 bits) is still a small minion."""
MIN_CONTEXT = 512


@dataclass(frozen=True)
class FittedProfile:
    """A profile as it will run: fitted to this machine where its target came from the command line."""

    profile: Profile
    machine: MachineMemory | None = None
    """This machine's free memory, where it is the device budget."""
    notes: tuple[str, ...] = ()
    """What was chosen for the command-line target and why."""

    def plan(self, math_dtype: str | None = None) -> MemoryPlan:
        plan = plan_memory(self.profile, math_dtype=math_dtype, machine=self.machine)
        return replace(plan, notes=self.notes)


def load_fitted(name_or_path: str | os.PathLike, *, target: str | None = None, minions: Iterable[str] | None = None,
                tier: str | None = None, machine: MachineMemory | None = None, rpc: Iterable[str] | None = None,
                rpc_split: Iterable[float] | None = None) -> FittedProfile:
    """load_profile with the command line's overrides; a GGUF `target` on a CPU profile is
    fitted to this machine (`machine`: its free memory, measured when not given). `rpc`,
    `rpc_split`: the target's [target] rpc and rpc_split (--rpc, --rpc-split)."""
    profile = with_rpc(load_profile(name_or_path, target=target, minions=minions, tier=tier), rpc, rpc_split)
    if target is None or profile.target.format != "gguf" or profile.hardware.device != "cpu":
        return FittedProfile(profile)
    return fit_to_machine(profile, minions_named=minions is not None, tier_named=tier is not None,
                          machine=machine or usable_memory())


def with_rpc(profile: Profile, rpc: Iterable[str] | None, rpc_split: Iterable[float] | None) -> Profile:
    """The profile with the command line's RPC servers and split (checked as a profile's)."""
    if rpc is None and rpc_split is None:
        return profile
    from pydantic import ValidationError

    from minions_local.core.errors import ProfileError
    from minions_local.profile.schema import TargetSection

    update = {"rpc": list(rpc)} if rpc is not None else {}
    if rpc_split is not None or rpc is not None:
        update["rpc_split"] = list(rpc_split) if rpc_split is not None else None
    try:
        target = TargetSection.model_validate({**profile.target.model_dump(), **update})
    except ValidationError as err:
        raise ProfileError(f"--rpc: {err.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    return profile.model_copy(update={"target": target})


def fit_to_machine(profile: Profile, *, minions_named: bool, tier_named: bool,
                   machine: MachineMemory | None) -> FittedProfile:
    model = read_model(profile.target.path)  # a missing, truncated or foreign file is named here
    dims = dims_for(profile.target.path, None, "target")
    if gguf_on_llama_cpp(profile.target.gguf_kernel, "cpu"):
        _check_llama_cpp_loads(model.path)
    first = str(model.path)  # a split model by its first shard, as llama.cpp wants it (and a substitute's source)
    profile = profile.model_copy(update={
        "target": profile.target.model_copy(update={"path": first}),
        "minions": [m.model_copy(update={"path": first}) if m.kind == "substitute" else m for m in profile.minions]})
    hardware, target = profile.hardware, profile.target
    if machine is not None:
        hardware = hardware.model_copy(update={"device_memory_gb": machine.usable / GB, "device_reserve_gb": 0.0,
                                               "host_ram_gb": 0.0, "disk_budget_gb": model.size / GB})
        if target.tier != "device" or not tier_named:  # on a CPU, what RAM does not hold comes from the file
            target = target.model_copy(update={"tier": "disk"})
    notes = [] if machine is not None else ["memory: the profile's budgets (this system does not say how much "
                                            "memory is free)"]
    if minions_named:
        minions, said = _named_minions(profile)
    else:
        minions, said = _chosen_minions(profile, model.path, model.size)
    notes += said
    fitted = profile.model_copy(update={"hardware": hardware, "target": target, "minions": minions})
    fitted, said = _fit_context(fitted, dims, machine)
    return FittedProfile(fitted, machine, tuple(notes + said))


def _check_llama_cpp_loads(path: Path) -> None:
    from minions_local.backends.llama_context import llama_cpp_refusal

    said = llama_cpp_refusal(path)
    if said:
        architecture = unknown_architecture(said)
        raise ModelLoadError(unknown_architecture_message(path, architecture) if architecture else
                             f"llama.cpp cannot load {path}: {said}. Re-download or re-export it.")


def _named_minions(profile: Profile) -> tuple[list[MinionSection], list[str]]:
    """The --minion models as named, each checked against the target's vocabulary now."""
    for m in profile.minions:
        if m.kind in ("gguf", "hf") and m.path:
            check_same_tokens(profile.target.path, m.path)
    return list(profile.minions), [f"minions: as named with --minion ({', '.join(m.name for m in profile.minions)})"]


def _chosen_minions(profile: Profile, target: Path, size: int) -> tuple[list[MinionSection], list[str]]:
    listed = [Path(m.path) for m in profile.minions if m.kind in ("gguf", "hf") and m.path]
    search = find_minions(target, size, model_tokens(target), listed)
    minions = [MinionSection(kind=f.kind, path=str(f.path)) for f in search.chosen]
    notes = [f"minion {m.name}: {size_text(f.size)}, {f.where}, on the target's vocabulary"
             for m, f in zip(minions, search.chosen)]
    for m in profile.minions:
        if m.kind != "substitute":
            continue
        if size < SUBSTITUTE_BELOW:
            minions.append(m)
            notes.append(f"minion {m.name}: the target re-quantized to {m.quantization} by llama.cpp (made once "
                         f"into the cache), small beside a target of {size_text(size)}")
        else:
            notes.append(f"no '{m.name}' substitute: the target re-quantized would be nearly as large as the "
                         f"target ({size_text(size)}); one is made only for targets under "
                         f"{size_text(SUBSTITUTE_BELOW)}")
    if not search.chosen:
        drafts = "n-gram and the substitute draft" if minions else "only n-gram drafts"
        notes.append(f"no small model on the target's vocabulary was found beside it, so {drafts}; name one with "
                     f"--minion PATH (a .gguf or a Hugging Face folder of the same family, under a tenth of the "
                     f"target's size)")
    if search.passed_over:
        notes.append("passed over: " + ", ".join(search.passed_over[:6])
                     + (f" and {len(search.passed_over) - 6} more" if len(search.passed_over) > 6 else ""))
    minions.append(MinionSection(kind="ngram"))
    return minions, notes


def _fit_context(profile: Profile, dims: ModelDims, machine: MachineMemory | None) -> tuple[Profile, list[str]]:
    """The profile with the longest context that the model takes and the memory holds."""
    asked = profile.target.context_tokens
    context = min(asked, dims.max_context or asked)
    notes = [] if context == asked else [f"context: {context} tokens, what the model was trained for"]
    while True:
        fitted = profile.model_copy(update={"target": profile.target.model_copy(update={"context_tokens": context})})
        try:
            plan_memory(fitted, target_dims=dims, machine=machine)
        except MemoryPlanError:
            if machine is None or context <= MIN_CONTEXT:
                raise
            context = max(MIN_CONTEXT, context // 2)
            continue
        if context < min(asked, dims.max_context or asked):
            notes = [f"context: {context} tokens, not {asked}: a longer one's KV cache leaves too little of this "
                     f"memory for the rest"]
        return fitted, notes

