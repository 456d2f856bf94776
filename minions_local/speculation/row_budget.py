"""Splitting one target pass's rows between the requests that share it.

A streamed pass costs its reads plus a little per row, so k requests sharing it pay
nearly what one pays alone. Each request's tree buys it expected accepted tokens
(its gains curve) at the price of its own growing and of the rows it adds to the
shared pass. The split maximises accepted tokens per second summed over the
requests:

    sum_r (1 + gain_r(n_r))  /  (sum_r grow_r(n_r) + t_verify(sum_r (n_r + 1) - 1))

Growing is summed because the minions grow one request's tree after another on the
same cores; the verify term counts every request's root as a row. A request whose
tree does not pay keeps n_r = 0: plain decoding inside the shared pass.

The search is a greedy walk: from no trees at all, it repeatedly takes the one move
(any request's tree, larger or smaller by 1, 2, 4, ... nodes) that raises the rate
most, and stops when none does. Doubling steps let it jump over a minion pass's fixed
cost, which a one-node step alone would never find worth paying; shrinking moves undo
an early enlargement that later ones made a poor use of the pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TreeCurve:
    """What trees of each size give one request and cost it: gains[n] expected
    accepted draft tokens for the best n-node tree, grow[n] seconds to grow it."""

    gains: Sequence[float]
    grow: Sequence[float]

    @property
    def max_nodes(self) -> int:
        return len(self.gains) - 1


def split_rows(curves: Sequence[TreeCurve], verify: Callable[[int], float]) -> list[int]:
    """Draft nodes per request; verify(N) is the pass's seconds for N draft nodes plus
    one root (so the k roots of a shared pass count as k - 1 extra nodes)."""
    k = len(curves)
    nodes = [0] * k
    tokens = float(k)
    growing = 0.0
    rows = k

    def rate(tok: float, grow: float, total_rows: int) -> float:
        return tok / (grow + verify(total_rows - 1))

    best = rate(tokens, growing, rows)
    while True:
        pick, pick_rate = None, best * (1 + 1e-9)
        for r, c in enumerate(curves):
            n = nodes[r]
            for m in _moves(n, c.max_nodes):
                trial = rate(tokens + c.gains[m] - c.gains[n], growing + c.grow[m] - c.grow[n], rows + m - n)
                if trial > pick_rate:
                    pick, pick_rate = (r, m), trial
        if pick is None:
            return nodes
        r, m = pick
        c = curves[r]
        tokens += c.gains[m] - c.gains[nodes[r]]
        growing += c.grow[m] - c.grow[nodes[r]]
        rows += m - nodes[r]
        nodes[r] = m
        best = pick_rate


def _moves(n: int, most: int) -> list[int]:
    """Sizes one move may take a tree of n nodes to: n +- 1, 2, 4, ... within 0..most."""
    out, step = [], 1
    while n + step <= most or n - step >= 0:
        out += [m for m in (n + step, n - step) if 0 <= m <= most]
        step *= 2
    return out
