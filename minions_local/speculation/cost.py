"""The offload-aware cost model: how long a step takes, and which tree size pays best.

Pure: a function of (profile timings, model dims, acceptance statistics). No torch.

Verification of a tree of N draft nodes (T = N + 1 tokens with the root) is

    t_verify(N) = max(flat, base + slope * T)
    flat  = overhead + max(stream, floor)     stream: streamed bytes / link GB/s per tier
    base  = overhead                          floor:  all weights read once from device memory
    slope = flops per token / throughput      overhead: per-layer launch cost x layers

i.e. a streamed target costs the same for any tree until compute catches up with the
weight traffic; that is why large trees pay off. Each minion's forward pass costs
`base + per_token * width` (its own weight-read floor and launch overhead, then flops);
growing a tree of depth D takes D passes.

Expected accepted tokens come from `accepted_by_tree_size` below: an ESTIMATE from a
simple tree model, not a measurement. Online refinement: `refined(...)` refits the
coefficients to measured (N, seconds) samples (cost_fit.py).

    model = cost_model_from_profile(load_profile("rtx4090-70b"))   # prior (planning/cost_prior.py)
    choice = model.best_budget(0.8, max_nodes=512, max_depth=24)  # BudgetChoice
    model = model.refined(verify_samples=[(nodes, seconds), ...])
    # or, as a decoder BudgetPolicy that does all of this online: cost_policy.CostModelBudget
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Mapping, Sequence

from minions_local.speculation.budget import grow_shape, width_for
from minions_local.speculation.cost_fit import PRIOR_WEIGHT, fit_constant, fit_hinge, fit_line, fit_plane

Acceptance = float | Sequence[float]

# Chance that the minions' r-th ranked child is the target's token given that ranks
# 1..r-1 were not: a * SIBLING_DECAY**(r-1). Sequoia/SpecExec report acceptance vectors
# that fall off about this fast; a stated guess until calibration replaces it.
SIBLING_DECAY = 0.5
STEP_OVERHEAD_S = 0.001  # voting, tree packing and bookkeeping per step (Python)


@dataclass(frozen=True)
class VerifyTime:
    """t(N) = max(flat, base + slope * (N + 1)) seconds for N draft nodes, except that
    a pass of the root alone (N = 0) may have a time of its own, `single`, once one is
    measured: a one-row pass can take another kernel path. On a CPU without bf16
    kernels (2-core AVX2 EPYC, cpu-demo-disk) it took 212 ms against 346 for 8 rows and
    367 for 16: fitted through all of them, the line's slope came out 9 ms a row
    instead of ~3, and trees looked three times dearer than they were."""

    flat: float
    base: float
    slope: float
    single: float | None = None

    def __call__(self, nodes: int) -> float:
        if nodes == 0 and self.single is not None:
            return self.single
        return max(self.flat, self.base + self.slope * (nodes + 1))

    def fit(self, samples: Sequence[tuple[int, float]], weight: float = PRIOR_WEIGHT) -> "VerifyTime":
        """Refit to measured (nodes, seconds) samples, with self as the prior: the line
        to passes with draft nodes, `single` to those without."""
        pts = [(n + 1, s) for n, s in samples if n > 0]
        line = fit_hinge(pts, (self.flat, self.base, self.slope), weight) if pts else (self.flat, self.base,
                                                                                     self.slope)
        root_only = [s for n, s in samples if n == 0 and s > 0]
        single = self.single
        if root_only:
            prior = self.single if self.single is not None else self(0)
            single = fit_constant(root_only, prior, weight, sum(root_only) / len(root_only))
        flat, base, slope = line
        if single is not None and flat > single:
            # The floor is reading the weights, which a 1-row pass does too: it cannot cost more
            # than that pass. A prior from the profile's bandwidth can (the 8B-shaped GGUF on a
            # 2-core EPYC: flat 0.58 s from cpu-demo's bandwidth, 1 row measured 0.23 s), and
            # with passes timed only at 5 and 25 rows nothing pulled it down: trees of 2-7
            # nodes were priced at 0.58 s where they took 0.30-0.50, and the policy read alone.
            flat = single
        return VerifyTime(flat, base, slope, single=single)


@dataclass(frozen=True)
class GrowTime:
    """One minion: a forward pass over `width` new nodes costs base + per_token * width."""

    name: str
    base: float
    per_token: float

    def pass_seconds(self, width: int) -> float:
        return self.base + self.per_token * width

    def __call__(self, nodes: int, depth: int, width: int | None = None) -> float:
        """Growing `nodes` nodes at most `depth` levels deep: one pass per level
        (budget.grow_shape); a `width` narrower than that shape's takes more passes."""
        if nodes <= 0 or depth <= 0:
            return 0.0
        passes, spread = grow_shape(nodes, depth)
        width = width or spread
        return max(passes, math.ceil(nodes / width)) * self.pass_seconds(width)

    def fit(self, samples: Sequence[tuple[int, float]], weight: float = PRIOR_WEIGHT) -> "GrowTime":
        """Refit to measured (width, seconds per pass) samples, with self as the prior."""
        base, per_token = fit_line(samples, (self.base, self.per_token), weight)
        return replace(self, base=base, per_token=per_token)


@dataclass(frozen=True)
class BudgetChoice:
    """The tree size the cost model recommends, and what it expects of it."""

    nodes: int
    depth: int
    width: int
    expected_accepted: float
    """Estimated draft tokens accepted per step (the target's bonus token not counted)."""
    t_grow: float
    t_verify: float

    @property
    def tokens_per_step(self) -> float:
        return self.expected_accepted + 1

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / (self.t_grow + self.t_verify)


@dataclass(frozen=True)
class CostModel:
    """Step-time predictions for one machine and one set of models."""

    verify: VerifyTime
    grow: tuple[GrowTime, ...] = ()
    step_overhead: float = STEP_OVERHEAD_S
    parts: Mapping[str, float] = field(default_factory=dict)
    """How the prior was built (seconds): stream_ram, stream_disk, floor, overhead, slope."""
    per_request: float = 0.0
    """Seconds each request beyond the first adds to a shared pass, whatever its rows:
    its own attention over its own cache, its mask, its cache writes (compact.py
    forward_parts). cpu-demo-disk, AVX2, 16 rows: 367 ms as one request's tree, 420 as
    16 requests' roots, ~3.5 ms a request; 32 rows: 405 against 503 ms."""

    # -- predictions -------------------------------------------------------------------
    def t_verify(self, nodes: int, requests: int = 1) -> float:
        """A pass over `nodes` draft nodes plus the roots, `requests` of them (each
        root beyond the first counts among the nodes)."""
        return self.verify(nodes) + self.per_request * (requests - 1)

    def t_grow(self, nodes: int, depth: int, width: int | None = None) -> float:
        """All minions grow in turn (they share the device), then the vote."""
        if nodes <= 0:
            return 0.0
        return self.step_overhead + sum(g(nodes, depth, width) for g in self.grow)

    def best_budget(
        self,
        acceptance: Acceptance,
        *,
        min_nodes: int = 1,
        max_nodes: int = 256,
        max_depth: int = 16,
        top_k: int = 8,
        sibling_decay: float = SIBLING_DECAY,
    ) -> BudgetChoice:
        """The (nodes, depth) maximising E[accepted + 1] / (t_grow + t_verify).

        sibling_decay: how much less likely each next-ranked child is (see
        accepted_by_tree_size); calibrated online, it decides deep-narrow vs shallow-wide.

        Depth caps are searched too: a shallower tree needs fewer minion passes, which
        matters when growing is not cheap next to verifying.
        """
        key = acceptance_key(acceptance)
        t_verify = [self.t_verify(n) for n in range(max_nodes + 1)]
        # t_grow inlined, for speed: every minion grows the same shape, and the best
        # n-node tree is never deeper than n, so it takes one pass per level.
        base = sum(g.base for g in self.grow)
        per_token = sum(g.per_token for g in self.grow)
        best_rate, best_n, best_cap = -1.0, 0, 1
        for cap in _depth_caps(max_depth):
            gains, depths = accepted_by_tree_size(key, max_nodes, cap, top_k, sibling_decay)
            for n in range(min(min_nodes, len(gains) - 1), len(gains)):
                d = depths[n]
                grow = self.step_overhead + d * (base + per_token * width_for(n, d)) if n else 0.0
                rate = (gains[n] + 1) / (grow + t_verify[n])
                if rate > best_rate * (1 + 1e-9):
                    best_rate, best_n, best_cap = rate, n, cap
        gains, depths = accepted_by_tree_size(key, max_nodes, best_cap, top_k, sibling_decay)
        return self._choice(best_n, depths[best_n], gains[best_n])

    def _choice(self, nodes: int, depth: int, gain: float) -> BudgetChoice:
        width = grow_shape(nodes, depth)[1] if depth else 0
        return BudgetChoice(
            nodes=nodes,
            depth=depth,
            width=width,
            expected_accepted=gain,
            t_grow=self.t_grow(nodes, depth, width or None),
            t_verify=self.t_verify(nodes),
        )

    # -- refinement ------------------------------------------------------------------
    def refined(
        self,
        verify_samples: Sequence[tuple[int, float]] = (),
        grow_samples: Mapping[str, Sequence[tuple[int, float]]] | None = None,
        weight: float = PRIOR_WEIGHT,
    ) -> "CostModel":
        """A new model fitted to measurements, this one as the prior.

        verify_samples: (draft nodes, t_verify seconds[, requests sharing the pass]) per
            pass; a shared pass's nodes count every root beyond the first.
        grow_samples: per minion name, (width, seconds per forward pass).
        weight: how many samples' worth the prior counts for.
        """
        verify, per_request = self._fit_verify(verify_samples, weight)
        grow_samples = grow_samples or {}
        grow = tuple(
            g.fit(grow_samples[g.name], weight) if grow_samples.get(g.name) else g for g in self.grow
        )
        return replace(self, verify=verify, grow=grow, per_request=per_request)

    def _fit_verify(self, samples: Sequence[tuple], weight: float) -> tuple[VerifyTime, float]:
        """The line and the per-request cost. The line's fit says which passes lie on
        its sloped part; there base, slope and per-request cost are fitted together
        (rows and requests grow together in shared passes: fitted in turn, the line
        would keep most of the requests' cost), then the line again, to the passes less
        their requests' cost."""
        if not samples:
            return self.verify, self.per_request
        points = [(s[0], s[1], s[2] if len(s) > 2 else 1) for s in samples]
        verify = self.verify.fit([(n, t - self.per_request * (k - 1)) for n, t, k in points], weight)
        sloped = [(n + 1, k - 1, t) for n, t, k in points
                  if n > 0 and verify.base + verify.slope * (n + 1) >= verify.flat]
        if not any(k for _, k, _ in sloped):
            return verify, self.per_request
        per_request = fit_plane(sloped, (verify.base, verify.slope, self.per_request), weight)[2]
        return self.verify.fit([(n, t - per_request * (k - 1)) for n, t, k in points], weight), per_request


# -- the acceptance estimate ---------------------------------------------------------------


def acceptance_key(acceptance: Acceptance) -> tuple[float, ...]:
    """A hashable acceptance vector, rounded to 0.01 (an estimate; keeps the cache hot)."""
    values = (acceptance,) if isinstance(acceptance, (int, float)) else tuple(acceptance)
    if not values:
        raise ValueError("acceptance needs at least one rate")
    return tuple(min(max(round(float(a), 2), 0.0), 0.999) for a in values)


def _depth_caps(max_depth: int) -> list[int]:
    caps = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, max_depth}
    return sorted(c for c in caps if c <= max_depth)


@lru_cache(maxsize=256)
def accepted_by_tree_size(
    acceptance: tuple[float, ...], max_nodes: int, max_depth: int = 16, top_k: int = 8,
    sibling_decay: float = SIBLING_DECAY,
) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """ESTIMATE of accepted draft tokens for the best tree of n nodes, n = 0..max_nodes.

    Model: at depth d the minions' top-ranked child is the target's token with
    probability a_d (acceptance[d-1], the last rate repeating); the r-th ranked child,
    given that ranks before it were not, with a_d * sibling_decay**(r-1). A node is
    accepted iff every node on its path is, so E[accepted] = sum over the tree's nodes
    of their path probabilities, and the best n-node tree holds the n most probable
    nodes: found best-first, as SpecExec grows its trees.

    Returns (gains, depths): gains[n] = E[accepted] and depths[n] = tree depth for the
    best n-node tree. May stop early when no node is left (max_depth x top_k bound).
    """
    def rank_prob(depth: int, rank: int) -> float:
        a = acceptance[min(depth, len(acceptance)) - 1]
        miss = 1.0
        for r in range(1, rank):
            miss *= 1.0 - a * sibling_decay ** (r - 1)
        return a * sibling_decay ** (rank - 1) * miss

    gains, depths = [0.0], [0]
    # heap entries: (-path prob, parent's path prob, depth, rank among siblings)
    heap = [(-rank_prob(1, 1), 1.0, 1, 1)]
    while heap and len(gains) <= max_nodes:
        neg, parent_p, depth, rank = heapq.heappop(heap)
        p = -neg
        gains.append(gains[-1] + p)
        depths.append(max(depths[-1], depth))
        if depth < max_depth:
            heapq.heappush(heap, (-p * rank_prob(depth + 1, 1), p, depth + 1, 1))
        if rank < top_k:
            heapq.heappush(heap, (-parent_p * rank_prob(depth, rank + 1), parent_p, depth, rank + 1))
    return tuple(gains), tuple(depths)
