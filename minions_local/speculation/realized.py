"""What shared passes realize, with trees and without, per batch size: the cost
model's check against the clock.

The row split (row_budget.py) trusts fitted prices: the pass's time per row, each
minion's per level and per node, the acceptance of each regime. Each is fitted well
enough alone, but a batch's trees win or lose by a few percent of a pass, and there
the fits' errors and what they leave out (a vote and a commit per request, the
minions' reads of tokens they missed) decide. Measured on cpu-demo-disk (2-core
AVX-512 EPYC, 16 chat requests, 128 tokens): the split's trees made 135 tok/s where
the same passes without trees made 195. So the policy also keeps, per batch size, the
tokens and seconds of its recent shared passes with trees and without, and lets
trees through only while they realize at least what plain passes do. Each side is
measured again now and then: one pass in `every` goes the other way.

Passes in which the minions read a prompt are left out of both: a prompt read is
paid once per request, and one 16-prompt read in a window of a dozen passes would
hide what a tree pass realizes. Reading the tokens decoded without a tree before the
next one is in: it is what going back and forth between the two costs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RealizedRates:
    window: int = 12
    """Recent passes kept per batch size and kind."""
    least: int = 4
    """Passes of a kind before its rate counts."""
    every: int = 16
    """One pass in this many measures the side the check has not been taking."""
    _passes: dict = field(default_factory=dict, repr=False)
    """(requests, with trees) -> deque of (tokens, seconds)."""
    _asked: dict = field(default_factory=dict, repr=False)
    """requests -> passes the check was asked about."""

    def add(self, requests: int, trees: bool, tokens: int, seconds: float) -> None:
        """One shared pass of `requests` requests that read no prompt."""
        if requests > 1 and seconds > 0:
            self._passes.setdefault((requests, trees), deque(maxlen=self.window)).append((tokens, seconds))

    def rate(self, requests: int, trees: bool) -> float | None:
        """Tokens per second of the recent passes of that kind (None: too few)."""
        passes = self._passes.get((requests, trees), ())
        if len(passes) < self.least:
            return None
        return sum(t for t, _ in passes) / sum(s for _, s in passes)

    def admit_trees(self, requests: int) -> bool:
        """Let the next pass of `requests` requests grow the trees the split chose, or
        not: not while trees realize less than plain passes at this batch size, nor on
        the pass that measures plain decoding while it has too few samples (one in
        `every`); trees that lost are tried again one pass in `every`. Each call counts
        as a pass of that batch size (what `every` counts). A lone request's trees
        always go through: its passes are not measured (`add`), and its tree is the
        cost model's best for it alone, fitted to those very passes."""
        if requests < 2:
            return True
        asked = self._asked[requests] = self._asked.get(requests, 0) + 1
        turn = asked % self.every == 0
        plain, trees = self.rate(requests, False), self.rate(requests, True)
        if plain is None:
            return not turn
        if trees is not None and trees < plain:
            return turn
        return True
