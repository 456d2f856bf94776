"""Each minion's real price per grow pass, and the target's per verify pass, timed once at load.

Why: the profile's prior for a minion's pass is physics (bytes over bandwidth, flops
over the device's best throughput), and for a llama.cpp minion on a CPU it is ~10x
too cheap: its quantized kernels on one thread do ~70 GFLOP/s, not the torch/AMX
figure the profile states, so a 41-node tree costs 135 ms to grow where the prior
said ~20. The online refit corrects that only after the policy has paid for such
trees (and only for the widths it happened to try). A few grows on a made-up context
before the first request cost ~0.1-0.5 s of loading and give the refit real samples
at a narrow and a wide pass from the start.

The target's pass is timed too, at three tree sizes: its prior is physics as well, and
where compute is dearer than the profile says (SmolLM2 streamed on a 2-core AVX2 CPU:
8-10 ms a tree node where the profile's throughput gives 1), the steps' own samples,
all at the one tree size the policy picked, could not tell a flat pass from a sloped
one: the refit raised the flat part, predicted a 42-node tree at 278 ms, and paid
330-400 ms for each until its next refit.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from minions_local.core.events import LoadProgress
from minions_local.core.minion import BaseMinion
from minions_local.core.protocols import GrowBudget, Minion, Target
from minions_local.core.tree import TokenTree
from minions_local.speculation.budget import BudgetPolicy, grow_shape
from minions_local.speculation.timing import timed

SHAPES = ((2, 2), (16, 2), (32, 2))
"""(nodes, depth) of the timed trees: passes of width 1, 8 and 16 after the first."""


def time_grow_passes(minion: Minion, vocab: int, shapes: Sequence[tuple[int, int]] = SHAPES,
                     top_k: int = 8) -> list[tuple[int, float]]:
    """(width, seconds per pass) of `minion` growing each shape, as the policy's refit
    counts them (cost_policy.grow_samples): each grow follows a context two tokens
    longer than the last, as a step does after accepting a token or two."""
    # A short chat prompt's length: reading it is a pass of its own (160 tokens were 0.86 s
    # of the SmolLM2 GGUF minion's 1.1 s here, on 2 cores), and a grow's cost barely
    # depends on it (a small model's matmuls, not its attention, make a pass).
    context = [(7 * i + 3) % max(vocab, 2) for i in range(1, 49)]
    minion.prefill(context)
    minion.grow(context, GrowBudget(max_nodes=shapes[0][0], max_depth=shapes[0][1], top_k=top_k))  # warm-up
    samples = []
    with _no_gc_pause():
        for nodes, depth in shapes:
            context = context + [(context[-1] * 5 + 11) % max(vocab, 2), (context[-1] * 3 + 1) % max(vocab, 2)]
            passes, width = grow_shape(nodes, depth)
            _, seconds = timed(minion.grow, context, GrowBudget(max_nodes=nodes, max_depth=depth, width=width,
                                                                top_k=top_k))
            samples.append((width, seconds / passes))
    minion.reset()  # the made-up context is nobody's conversation
    return samples


VERIFY_SIZES = (0, 4, 24)
"""Draft nodes of the target's timed passes: a 1-token pass (what a step without a tree
costs), a small tree and one a CPU still verifies in a few 1-token passes' time (on a
GPU all three cost the same: the reads). A CPU's matmuls get cheaper per row as rows
are added (2-core AVX2, float32: 1 row 0.12 ms, 2 rows 0.22, 8 rows 0.27), so a line
through the 1-token pass alone would price small trees low (by 13% in a run)."""


def time_verify_passes(target: Target, vocab: int, sizes: Sequence[int] = VERIFY_SIZES, *,
                       warm_up: bool = True, first_untimed: bool = False, repeats: int = 1,
                       budget_s: float | None = None) -> list[tuple[int, float]]:
    """(draft nodes, seconds) of the target verifying a chain of each size below a
    made-up context. Leaves the target reset.

    warm_up: whether the target's first passes cost more than later ones (a torch
    target's streamed layers check their CRC on their first read): a 16-token context is
    read and one pass runs untimed before the timed ones. The context is short because
    reading it is a pass of its own (an 8B-shaped GGUF on 2 cores: 16 rows 1.0 s, 64 rows
    2.6 s) and the cost of a pass barely depends on it. Without (a llama.cpp target,
    whose every pass takes its layers through the page cache as the first does), the
    passes are timed from the first, on a 1-token context: at 8B under a memory limit
    each pass is seconds of loading (the two untimed ones were 4 of a first chat's 20).
    first_untimed: the untimed pass alone, on the 1-token context (time_pass_shape).
    repeats: passes of each size, the least time kept (a target split over RPC servers
    asks them questions the first time a pass has a new shape, which ggml then caches:
    its second pass of a size is what decoding pays; and one sample on a shared machine
    is not a price). budget_s: a size's passes stop after the second once they have taken
    this long."""
    context = [(11 * i + 5) % max(vocab, 2) for i in range(1, 17 if warm_up else 2)]
    target.prefill(context)
    samples = []
    with _no_gc_pause():
        untimed = (sizes[0],) if warm_up or first_untimed else ()
        for k, nodes in enumerate((*untimed, *sizes)):
            tree = TokenTree.from_root(context[-1])
            parent = 0
            for i in range(nodes):
                parent = tree.add(parent, (context[i % len(context)] * 7 + i) % max(vocab, 2))
            passes = 1 if k < len(untimed) else repeats
            times: list[float] = []
            while len(times) < passes and (budget_s is None or len(times) < 2 or sum(times) < budget_s):
                times.append(timed(target.verify, context, tree)[1])
            samples.append((nodes, min(times)))
    target.reset()  # the made-up context is nobody's conversation
    return samples[len(untimed):]


def time_pass_shape(target: Target, sizes: Sequence[int] = VERIFY_SIZES, *, repeats: int = 5,
                    budget_s: float = 0.1) -> list[tuple[int, float]]:
    """time_verify_passes on a 1-token context, after one untimed 1-token pass: how a
    pass's time grows with its tree, measured on a cut of a model (llama_check_model.py),
    scaled to the model's size by llama_check_model.pass_bytes_ratio.

    Each size's least time over at least two passes (up to `repeats`, while they have
    taken under `budget_s`): the shape is kept with the file's verdict for every later
    load, and one sample is not a price. On a shared 2-core box (AVX-512 EPYC) a tiny
    model's passes moved by 2x from one to the next, and CI once priced a 0.3 ms pass at
    0.6. An 8B-shaped Q4_K_M's cut (same box): 0.59 s for its shape at first load, not
    0.35, and a 24-node pass priced at 1.27 s where one sample had said 1.58 (1.35 and
    1.96 in another run)."""
    return time_verify_passes(target, target.vocab_size, sizes, warm_up=False, first_untimed=True, repeats=repeats,
                              budget_s=budget_s)


def time_lone_pass(target: Target) -> float:
    """Seconds of one 1-token pass of `target` on a 1-token context, timed from its first
    (time_verify_passes without warm-up): what a streamed llama.cpp target's reads cost a
    pass, added to its cut's shape (llama_load.py)."""
    return time_verify_passes(target, target.vocab_size, (0,), warm_up=False)[0][1]


@contextmanager
def _no_gc_pause() -> Iterator[None]:
    """One sample per shape: a garbage collection landing in one (~50 ms after torch's
    import, measured) would price a pass at ten times its cost."""
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def calibrate_policy(policy: BudgetPolicy, minions: Sequence[BaseMinion], vocab: int,
                     progress: Callable[[LoadProgress], None] | None = None,
                     target: Target | None = None, target_warm_up: bool = True, target_repeats: int = 1,
                     target_timed: Sequence[tuple[int, float]] = ()) -> dict[str, list[tuple[int, float]]]:
    """Time the minions whose passes cost something, and the target's pass when given
    (under the key "target"; `target_warm_up`, `target_repeats`: time_verify_passes's
    `warm_up` and `repeats`; `target_timed`:
    (draft nodes, seconds) of passes it already ran at load, taken instead when they span
    several sizes), and fold the samples into the prior of a policy that
    `uses_timed_passes` (any other policy, or no minions, is left alone). Returns the
    samples."""
    if not policy.uses_timed_passes or not minions:
        return {}
    samples = {m.name: _reported(progress, m.name, lambda m=m: time_grow_passes(m, vocab))
               for m in minions if not m.depth_is_free}
    verify: list[tuple[int, float]] = []
    if len({nodes for nodes, _ in target_timed}) >= 3:
        verify = list(target_timed)
    elif target is not None:
        verify = _reported(progress, "target", lambda: time_verify_passes(target, vocab, warm_up=target_warm_up,
                                                                       repeats=target_repeats))
    if samples or verify:
        policy.calibrate(samples, verify)
    return samples | ({"target": verify} if verify else {})


def _reported(progress: Callable[[LoadProgress], None] | None, name: str,
              timing: Callable[[], list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """`timing()`, shown as a loading step of the model `name`."""
    if progress:
        progress(LoadProgress(name, "device", 0, 1, "timing its passes for the cost model"))
    samples = timing()
    if progress:
        progress(LoadProgress(name, "device", 1, 1, "ready"))
    return samples
