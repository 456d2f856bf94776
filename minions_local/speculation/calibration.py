"""Each minion's real price per grow pass, timed once at load.

Why: the profile's prior for a minion's pass is physics (bytes over bandwidth, flops
over the device's best throughput), and for a llama.cpp minion on a CPU it is ~10x
too cheap: its quantized kernels on one thread do ~70 GFLOP/s, not the torch/AMX
figure the profile states, so a 41-node tree costs 135 ms to grow where the prior
said ~20. The online refit corrects that only after the policy has paid for such
trees (and only for the widths it happened to try). A few grows on a made-up context
before the first request cost ~0.1-0.5 s of loading and give the refit real samples
at a narrow and a wide pass from the start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from minions_local.core.events import LoadProgress
from minions_local.core.protocols import GrowBudget, Minion
from minions_local.speculation.budget import grow_shape

SHAPES = ((2, 2), (16, 2), (32, 2))
"""(nodes, depth) of the timed trees: passes of width 1, 8 and 16 after the first."""


def time_grow_passes(minion: Minion, vocab: int, shapes: Sequence[tuple[int, int]] = SHAPES,
                     top_k: int = 8) -> list[tuple[int, float]]:
    """(width, seconds per pass) of `minion` growing each shape, as the policy's refit
    counts them (cost_policy.grow_samples): each grow follows a context two tokens
    longer than the last, as a step does after accepting a token or two."""
    context = [(7 * i + 3) % max(vocab, 2) for i in range(1, 161)]  # a chat prompt's length
    minion.prefill(context)
    minion.grow(context, GrowBudget(max_nodes=shapes[0][0], max_depth=shapes[0][1], top_k=top_k))  # warm-up
    samples = []
    for nodes, depth in shapes:
        context = context + [(context[-1] * 5 + 11) % max(vocab, 2), (context[-1] * 3 + 1) % max(vocab, 2)]
        passes, width = grow_shape(nodes, depth)
        start = time.perf_counter()
        minion.grow(context, GrowBudget(max_nodes=nodes, max_depth=depth, width=width, top_k=top_k))
        samples.append((width, (time.perf_counter() - start) / passes))
    minion.reset()  # the made-up context is nobody's conversation
    return samples


def calibrate_policy(policy, minions: Sequence[Minion], vocab: int,
                     progress: Callable[[LoadProgress], None] | None = None) -> dict[str, list[tuple[int, float]]]:
    """Time the minions whose passes cost something and fold the samples into a
    cost-model policy's prior (any other policy is left alone). Returns the samples."""
    calibrate = getattr(policy, "calibrate", None)
    if calibrate is None:
        return {}
    samples = {}
    for minion in minions:
        if minion.depth_is_free:
            continue
        if progress:
            progress(LoadProgress(minion.name, "device", 0, 1, "timing its passes for the cost model"))
        samples[minion.name] = time_grow_passes(minion, vocab)
        if progress:
            progress(LoadProgress(minion.name, "device", 1, 1, "ready"))
    if samples:
        calibrate(samples)
    return samples
