"""Splitting one target pass's rows between the requests that share it.

A streamed pass costs its reads plus a little per row, so k requests sharing it pay
nearly what one pays alone. Each request's tree buys it expected accepted tokens
(its gains curve) at the price of its growing and of the rows it adds to the shared
pass. The split maximises accepted tokens per second summed over the requests:

    sum_r (1 + gain_r(n_r))  /  (growing(n_1..n_k) + t_verify(sum_r (n_r + 1) - 1))

Growing has two parts. What a request pays on its own (a minion that grows one
request's tree after another, its unread prompt, the vote) adds up over requests.
A minion that grows every request's tree in the same passes (grow_batch: llama.cpp
sequences in one context, a transformers minion's packed rows) pays its pass's fixed
cost once a tree level for all of them (`BatchGrowCost`): 8 chat requests' 1-node
trees took 16 ms in one llama.cpp pass against 41 ms one after another (2-core
AVX-512 EPYC, q3_k_m substitute), and pricing them as 8 lone grows made the split
decode 8 requests without trees while trees would have paid. The verify term counts
every request's root as a row. A request whose tree does not pay keeps n_r = 0: plain
decoding inside the shared pass.

The search is a greedy walk: from no trees at all, it repeatedly takes the one move
(any request's tree, larger or smaller by 1, 2, 4, ... nodes; with batch growing,
also every request's at once) that raises the rate most, and stops when none does. Doubling steps let it jump over a minion pass's fixed
cost, which a one-node step alone would never find worth paying; shrinking moves undo
an early enlargement that later ones made a poor use of the pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TreeCurve:
    """What trees of each size give one request and cost it: gains[n] expected
    accepted draft tokens for the best n-node tree, grow[n] the seconds of growing it
    that the request pays on its own, levels[n] its depth (the passes a shared-pass
    minion runs for it; empty: no minion shares passes)."""

    gains: Sequence[float]
    grow: Sequence[float]
    levels: Sequence[int] = ()

    @property
    def max_nodes(self) -> int:
        return len(self.gains) - 1


@dataclass(frozen=True)
class BatchGrowCost:
    """The price of the minions that grow several requests' trees in the same passes,
    one per tree level (grow_batch): a pass costs `base` plus `per_node` for each node it grows, and one pass serves up
    to `group` requests (more take a pass per group)."""

    base: float
    per_node: float
    group: int

    def __call__(self, levels: int, growers: int, nodes: int) -> float:
        """Seconds for `growers` requests' trees of `nodes` nodes in all, the deepest
        `levels` deep."""
        if growers <= 0:
            return 0.0
        return self.base * levels * -(-growers // max(1, self.group)) + self.per_node * nodes


def split_rows(curves: Sequence[TreeCurve], verify: Callable[[int], float],
               batch_cost: BatchGrowCost | None = None) -> list[int]:
    """Draft nodes per request; verify(N) is the pass's seconds for N draft nodes plus
    one root (so the k roots of a shared pass count as k - 1 extra nodes)."""
    k = len(curves)
    times = [verify(r - 1) for r in range(k + sum(c.max_nodes for c in curves) + 1)]
    nodes = [0] * k
    best = _rate(curves, times, batch_cost, nodes)
    while True:
        pick, pick_rate = None, best * (1 + 1e-9)
        for trial in _single_moves(curves, nodes) + _joint_moves(curves, nodes, batch_cost):
            rate = _rate(curves, times, batch_cost, trial)
            if rate > pick_rate:
                pick, pick_rate = trial, rate
        if pick is None:
            return nodes
        nodes, best = pick, pick_rate


def _single_moves(curves: Sequence[TreeCurve], nodes: list[int]) -> list[list[int]]:
    """Every split one request's move away."""
    return [nodes[:r] + [m] + nodes[r + 1:] for r, c in enumerate(curves) for m in _moves(nodes[r], c.max_nodes)]


def _joint_moves(curves: Sequence[TreeCurve], nodes: list[int], batch_cost: BatchGrowCost | None) -> list[list[int]]:
    """With batch growing, every request's tree (or every growing one's) larger or
    smaller by the same step: a shared pass's fixed cost pays only once several
    requests grow, and a level only once it is deeper for all, so from no trees no
    single request's first tree is worth it (8 requests, 1-node trees: any one of them
    127.3 against 127.6 tok/s without, all of them 175)."""
    if batch_cost is None:
        return []
    most = max((c.max_nodes for c in curves), default=0)
    steps = [sign * 2 ** i for i in range(most.bit_length()) for sign in (1, -1)]  # +-1, 2, 4, ... up to most
    out = []
    for step in steps:
        for growers_only in (False, True):
            trial = [n if growers_only and not n else min(max(n + step, 0), c.max_nodes)
                     for c, n in zip(curves, nodes)]
            if trial != nodes and trial not in out:
                out.append(trial)
    return out


def batch_grow_seconds(curves: Sequence[TreeCurve], batch_cost: BatchGrowCost | None, nodes: Sequence[int]) -> float:
    """What the minions that grow a batch's trees in shared passes take to grow these
    trees (0.0: none does)."""
    if batch_cost is None:
        return 0.0
    deepest = max((c.levels[n] if c.levels else 0) for c, n in zip(curves, nodes))
    return batch_cost(deepest, sum(n > 0 for n in nodes), sum(nodes))


def _rate(curves: Sequence[TreeCurve], times: Sequence[float], batch_cost: BatchGrowCost | None,
          nodes: Sequence[int]) -> float:
    """Tokens per second of the pass with these trees."""
    tokens = sum(1 + c.gains[n] for c, n in zip(curves, nodes))
    grow = sum(c.grow[n] for c, n in zip(curves, nodes)) + batch_grow_seconds(curves, batch_cost, nodes)
    return tokens / (grow + times[len(curves) + sum(nodes)])


def _moves(n: int, most: int) -> list[int]:
    """Sizes one move may take a tree of n nodes to: n +- 1, 2, 4, ... within 0..most."""
    out, step = [], 1
    while n + step <= most or n - step >= 0:
        out += [m for m in (n + step, n - step) if 0 <= m <= most]
        step *= 2
    return out
