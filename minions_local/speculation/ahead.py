"""Growing ahead: the minions keep drafting while the target verifies.

A streamed target's pass waits on reads, and on a CPU one torch thread keeps up with
them (measured on SmolLM2 from disk, 16-node trees: 74 ms a pass with 2 threads,
72-76 ms with 1). So while the target verifies step t, a minion that can
(`BaseMinion.grows_ahead`) goes on growing step t's tree, best first, on the core the
target leaves free. When the target's bonus token lands on a node it grew, step t+1
starts from the subtree below that node instead of from nothing: Minions' and
SPIN's pipelined drafting, with the bet spread over every likely outcome by the
tree's own best-first order instead of placed on one predicted path.

Nothing here touches correctness: the target still verifies every tree it is given.

Where it pays: when the minions have compute the target's pass leaves idle (a GPU
target, or CPU cores beyond torch's threads and the layer reader's). On this
project's 2-core box it does not, so "auto" leaves it off there. Measured on
cpu-demo-disk, 6 chat prompts x 128 tokens, on and off interleaved: the target's
pass went from 74 to 96 ms (one torch thread, and the minion and the layer reader
sharing the other core and the memory bus), more than the head start saved (the
bonus token landed on a node grown ahead in about half the steps, but only 4 nodes
were grown ahead per pass): 0.86x with the cost model's budget, 1.03x at a fixed 16-node tree.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from minions_local.core.minion import BaseMinion
from minions_local.core.protocols import AheadWindow, GrowBudget, Target

AHEAD_WIDTH = 2
"""Nodes per minion pass while growing ahead: a pass is what the target waits for
once its verification is done (~13 ms for 2 llama.cpp tokens on this CPU, ~40 for 8)."""


def ahead_budget(nodes: int, depth: int, top_k: int) -> GrowBudget:
    """How far a step's tree (`nodes` draft nodes, `depth` levels) may grow ahead:
    one more tree of the same shape below its leaves, as the next step would grow."""
    return GrowBudget(max_nodes=2 * nodes + 16, max_depth=2 * depth + 2, width=AHEAD_WIDTH, top_k=top_k)


class GrowingAhead:
    """The minions' ahead-growing for one target pass, on a thread of its own."""

    def __init__(self, minions: list[BaseMinion], budget: GrowBudget, verify_seconds: float) -> None:
        """verify_seconds: how long the target's pass is expected to take; a minion
        pass that would outlast it does not start (the decode loop would wait on it)."""
        self.window = AheadWindow(time.perf_counter() + verify_seconds)
        self.nodes = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(minions, budget), name="minions-ahead", daemon=True)
        self._thread.start()

    def _run(self, minions: list[BaseMinion], budget: GrowBudget) -> None:
        try:
            for m in minions:
                self.nodes += m.grow_ahead(budget, self.window)
        except BaseException as err:  # re-raised on the decode thread by finish()
            self._error = err

    def close(self) -> None:
        """The target's pass is over: start no more minion passes."""
        self.window.done.set()

    def finish(self) -> int:
        """Stop after the minion pass in flight, wait for it, and return the nodes grown
        ahead (re-raising what went wrong there: the minion has reset itself)."""
        self.close()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.nodes


@contextmanager
def core_for_minions(target: Target, active: bool) -> Iterator[None]:
    """While minions grow ahead on a CPU with no core to spare, the target's pass runs
    on one torch thread fewer: two thread pools spinning on the same cores are far
    slower than either alone (llama.cpp measured 6 ms a tree on an idle core, 140 ms
    on a busy one)."""
    threads = torch.get_num_threads()
    yield_one = active and target.device.type == "cpu" and threads > 1 and (os.cpu_count() or 1) <= threads
    if yield_one:
        torch.set_num_threads(threads - 1)
    try:
        yield
    finally:
        if yield_one:
            torch.set_num_threads(threads)


def ahead_pays(target: Target, setting: bool | str = "auto") -> bool:
    """Whether minions should grow ahead: `setting` True/False, or "auto": when the
    target's pass leaves them compute of their own (see the module docstring)."""
    if setting != "auto":
        return bool(setting)
    return target.device.type != "cpu" or (os.cpu_count() or 1) >= torch.get_num_threads() + 2
