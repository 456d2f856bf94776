"""The step's one clock: every duration a decode step records is read here.

The budget policy fits its cost model to these seconds (the minions' grows, the
target's pass, the whole step), so they must all be read the same way; keeping the
reads out of the step's control flow also lets the step read as its algorithm.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")


def timed(work: Callable[..., T], *args, **kwargs) -> tuple[T, float]:
    """`work(*args, **kwargs)` and the wall seconds it took."""
    start = time.perf_counter()
    out = work(*args, **kwargs)
    return out, time.perf_counter() - start


class StepClock:
    """One step's clock, started with the step: the whole step's seconds so far
    (`elapsed`), beside what `timed` measures of its parts."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


@dataclass(frozen=True)
class PassTotals:
    """A step's pass-wide measures, the same for every request that rode its pass (one
    or several): the target's pass, the policy's and the reads' time."""

    t_verify: float
    streamed: int
    rows: int
    requests: int
    t_policy: float
    t_read: float
    t_step: float | None
    """The whole step's wall time, when requests or prompt chunks shared it."""
