"""Statistics for the sampling tests: a draw must follow the target's distribution."""

from collections import Counter

import torch


def chi2_pvalue(observed: Counter, expected: dict, n: int) -> float:
    """Pearson chi-square p-value, pooling categories with expected count < 5."""
    stat, dof, pool_o, pool_e = 0.0, -1, 0, 0.0
    for key, p in expected.items():
        e = p * n
        if e < 5:
            pool_o, pool_e = pool_o + observed.get(key, 0), pool_e + e
            continue
        stat += (observed.get(key, 0) - e) ** 2 / e
        dof += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / max(pool_e, 1e-9)
        dof += 1
    assert sum(observed.values()) == n
    assert set(observed) <= set(expected), "sampled an outcome of probability 0"
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def first_two_tokens(engine, prompt: list[int], n: int, **sampling) -> tuple[Counter, int]:
    """n two-token sampled generations: how often each (first, second) pair came, and in
    how many the first step accepted a draft (both tokens from one target pass)."""
    seen, drafted = Counter(), 0
    for _ in range(n):
        out = engine.generate(prompt, max_new_tokens=2, **sampling)
        assert out.steps[0].regime == "sampled"
        seen[tuple(out.token_ids)] += 1
        drafted += out.steps[0].accepted > 0
    return seen, drafted


def two_token_law(target, prompt: list[int], sampling) -> dict[tuple[int, int], float]:
    """P(first, second) of the target decoding `prompt` alone under `sampling` (a
    SamplingParams), read from its own 1-token passes: what first_two_tokens must follow.
    Leaves the target reset."""
    from minions_local.core.sampling import processed_probs
    from minions_local.core.tree import TokenTree

    def law(context: list[int]) -> torch.Tensor:
        target.reset()
        return processed_probs(target.verify(context, TokenTree.from_root(context[-1]))[0], sampling)

    first = law(prompt)
    expected = {(a, b): float(first[a] * second[b]) for a in torch.nonzero(first).flatten().tolist()
                for second in [law(prompt + [a])] for b in torch.nonzero(second).flatten().tolist()}
    target.reset()
    return expected
