"""Running the methods: calibration (each method's fastest variant) and interleaved
rounds, prompt by prompt, greedy then sampled, every method in every round with its
start rotated, so load from other processes hits all methods alike."""

from __future__ import annotations

from benchmarks import report
from benchmarks.methods import Method, Run

TEMPERATURE = 0.7


def calibrate(groups: list[list[Method]], ids: list[int], max_new: int, repeats: int = 2) -> list[Method]:
    """The fastest candidate of each group, on one prompt, candidates interleaved."""
    best: dict[int, float] = {}
    for _ in range(repeats):
        for g, group in enumerate(groups):
            for c, method in enumerate(group):
                if len(group) == 1:
                    continue
                run = method.run(ids, max_new, 0.0, 0)
                key = g * 1000 + c
                best[key] = min(best.get(key, float("inf")), run.seconds / max(len(run.tokens), 1))
    return [min(enumerate(group), key=lambda ic: best.get(g * 1000 + ic[0], 0.0))[1] for g, group in enumerate(groups)]


def interleaved(methods: list[Method], prompts, modes: list[str], max_new: int,
                log) -> tuple[list[dict[str, Run]], list[str]]:
    rounds: list[dict[str, Run]] = []
    round_modes: list[str] = []
    for i, prompt in enumerate(prompts):
        for mode in modes:
            k = len(rounds) % len(methods)
            order = methods[k:] + methods[:k]  # nobody always runs first (or right after a given neighbour)
            temperature = 0.0 if mode == "greedy" else TEMPERATURE
            runs = {m.name: m.run(prompt.ids, max_new, temperature, seed=1000 + i) for m in order}
            rounds.append(runs)
            round_modes.append(mode)
            base = runs[report.BASELINE].tokens_per_second
            ratios = [f"{n} {r.tokens_per_second / base:.2f}x" for n, r in runs.items() if base and n != report.BASELINE]
            log(f"round {len(rounds)} ({prompt.source}, {mode}): baseline {base:.1f} tok/s; " + ", ".join(ratios))
    return rounds, round_modes
