"""A budget policy driven by the cost model, calibrated online from step records.

Plugs into the decoder like the simple policies in budget.py (`choose` before a
step, `observe` after it). Each step it asks the CostModel for the tree size that
maximises E[accepted + 1] / (t_grow + t_verify) and reports its predictions, so the
step record shows predicted next to measured times.

What it learns from the records, every `refit_every` steps over the last `window`:
- verify time: the cost model's coefficients, refit to (tree size, t_verify);
- grow time: one factor scaling every minion's predicted grow time (the record holds
  the minions' total, not each one's);
- acceptance: the single rate `a` for which the acceptance model's expected accepted
  length, summed over the trees actually verified, equals what was accepted. This
  calibrates the model to the trees the minions really grow. An estimate.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from statistics import median

from ..events import StepRecord
from .budget import StepBudget
from .cost import CostModel, expected_accepted


@dataclass
class CostModelBudget:
    """BudgetPolicy: the cost model's best budget under the calibrated acceptance rate."""

    model: CostModel
    min_nodes: int = 1
    max_nodes: int = 256
    max_depth: int = 16
    top_k: int = 8
    acceptance: float = 0.7
    """Starting estimate of the minions' top-1 acceptance rate (replaced by calibration)."""
    window: int = 64
    refit_every: int = 8
    _prior: CostModel | None = field(default=None, repr=False)
    _steps: deque = field(default_factory=deque, repr=False)
    _seen: int = 0

    def __post_init__(self) -> None:
        self._prior = self.model
        self._steps = deque(maxlen=self.window)

    @classmethod
    def from_profile(cls, profile, plan=None, **kwargs) -> "CostModelBudget":
        """Prior from the profile (memory plan included); limits from profile.speculation."""
        spec = profile.speculation
        limits = dict(min_nodes=spec.min_budget, max_nodes=spec.max_budget, max_depth=spec.max_depth,
                      top_k=spec.top_k)
        return cls(CostModel.from_profile(profile, plan), **{**limits, **kwargs})

    def choose(self, remaining_tokens: int) -> StepBudget:
        depth_cap = max(0, min(self.max_depth, remaining_tokens - 1))
        if depth_cap == 0:
            return StepBudget(nodes=0, depth=0, width=1, predicted_t_verify=self.model.t_verify(0),
                              predicted_t_grow=0.0)
        c = self.model.best_budget(self.acceptance, min_nodes=self.min_nodes, max_nodes=self.max_nodes,
                                   max_depth=depth_cap, top_k=self.top_k)
        return StepBudget(nodes=c.nodes, depth=c.depth, width=max(1, c.width),
                          predicted_t_verify=c.t_verify, predicted_t_grow=c.t_grow)

    def observe(self, record: StepRecord) -> None:
        self._steps.append(record)
        self._seen += 1
        if self._seen % self.refit_every == 0:
            self.refit()

    def refit(self) -> None:
        """Recalibrate acceptance, verify and grow times from the recent steps."""
        steps = list(self._steps)
        if not steps:
            return
        model = self._prior.refined(verify_samples=[(r.tree_size, r.t_verify) for r in steps])
        ratios = [r.t_grow / r.predicted_t_grow for r in steps if r.predicted_t_grow and r.t_grow > 0]
        if ratios:
            model = scale_grow(model, median(ratios) * self._grow_scale())
        self.model = model
        trees = [(r.tree_size, r.depth, r.accepted) for r in steps if r.tree_size > 0 and r.depth > 0]
        if trees:
            self.acceptance = calibrate_acceptance(trees, self.top_k)

    def _grow_scale(self) -> float:
        """The scale already applied to the prior's grow times (predictions used it)."""
        prior = sum(g.base for g in self._prior.grow)
        now = sum(g.base for g in self.model.grow)
        return now / prior if prior > 0 else 1.0


def scale_grow(model: CostModel, factor: float) -> CostModel:
    """The model with every minion's grow time multiplied by `factor` (from the prior's)."""
    grow = tuple(replace(g, base=g.base * factor, per_token=g.per_token * factor) for g in model.grow)
    return replace(model, grow=grow)


def calibrate_acceptance(trees: list[tuple[int, int, int]], top_k: int = 8) -> float:
    """The rate a with sum_i E[accepted | a, nodes_i, depth_i] = sum_i accepted_i.

    trees: (nodes, depth, accepted) of verified trees. Bisection: E grows with a.
    """
    observed = sum(acc for _, _, acc in trees)

    def predicted(a: float) -> float:
        total = 0.0
        for nodes, depth, _ in trees:
            gains, _ = expected_accepted((round(a, 2),), nodes, depth, top_k)
            total += gains[min(nodes, len(gains) - 1)]
        return total

    lo, hi = 0.01, 0.99
    if predicted(lo) >= observed:
        return lo
    if predicted(hi) <= observed:
        return hi
    for _ in range(8):  # 0.98 / 2**8 < 0.01, the cache's resolution
        mid = (lo + hi) / 2
        if predicted(mid) < observed:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 2)
