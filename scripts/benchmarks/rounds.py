"""Running the methods: calibration (each method's fastest candidate) and interleaved
rounds, prompt by prompt, greedy then sampled, every method in every round with its
start rotated, so load from other processes hits all methods alike."""

from __future__ import annotations

from benchmarks import report
from benchmarks.llama_child import MethodFailed
from benchmarks.methods import Method, Run

TEMPERATURE = 0.7


def calibrate(groups: list[list[Method]], ids: list[int], max_new: int, repeats: int,
              log) -> tuple[list[Method], dict[str, dict[str, float]]]:
    """The fastest candidate of each group on one prompt (greedy), candidates of all
    groups interleaved, best of `repeats` seconds per token. Returns the chosen
    methods and, per method, each candidate's ms per token (for the report)."""
    best: dict[tuple[int, int], float] = {}
    for _ in range(repeats):
        for g, group in enumerate(groups):
            for c, method in enumerate(group):
                if len(group) == 1 or best.get((g, c)) == float("inf"):
                    continue
                try:
                    run = method.run(ids, max_new, 0.0, 0)
                    per_token = run.seconds / max(len(run.tokens), 1)
                except MethodFailed as err:
                    log(f"calibration: {method.name} ({method.detail}, {method.threads} thread(s)) failed: {err}")
                    per_token = float("inf")
                best[g, c] = min(best.get((g, c), float("inf")), per_token)
    chosen: list[Method] = []
    table: dict[str, dict[str, float]] = {}
    for g, group in enumerate(groups):
        c = min(range(len(group)), key=lambda i: best.get((g, i), 0.0))
        if best.get((g, c), 0.0) == float("inf"):
            continue  # every candidate failed
        chosen.append(group[c])
        if len(group) > 1:
            table[group[c].name] = {f"{m.dtype}/{m.threads}t": round(1000 * best[g, i], 1)
                                    for i, m in enumerate(group) if best[g, i] != float("inf")}
    return chosen, table


def interleaved(methods: list[Method], prompts, modes: list[str], max_new: int, log,
                failures: list[str]) -> tuple[list[dict[str, Run]], list[str]]:
    """Every round: one prompt, one mode, every method. A method that fails (a llama.cpp
    child killed, say) is reported in `failures` and left out of later rounds."""
    rounds: list[dict[str, Run]] = []
    round_modes: list[str] = []
    active = list(methods)
    for i, prompt in enumerate(prompts):
        for mode in modes:
            k = len(rounds) % len(active)
            order = active[k:] + active[:k]  # nobody always runs first (or right after a given neighbour)
            temperature = 0.0 if mode == "greedy" else TEMPERATURE
            runs: dict[str, Run] = {}
            for m in order:
                try:
                    runs[m.name] = m.run(prompt.ids, max_new, temperature, seed=1000 + i)
                except MethodFailed as err:
                    if m.family == report.BASELINE:
                        raise
                    failures.append(f"{m.name} failed in round {len(rounds) + 1} and was dropped: {err}")
                    log(failures[-1])
                    active.remove(m)
            rounds.append(runs)
            round_modes.append(mode)
            base = runs[report.BASELINE].tokens_per_second
            ratios = [f"{n} {r.tokens_per_second / base:.2f}x" for n, r in runs.items()
                      if base and n != report.BASELINE]
            log(f"round {len(rounds)} ({prompt.source}, {mode}): baseline {base:.1f} tok/s; " + ", ".join(ratios))
    return rounds, round_modes
