"""Refining the cost model's few coefficients from measured step times.

Both fits are least squares on *relative* error (a 10 ms miss matters on a 50 ms step,
not on a 2 s one), with a light ridge pull toward the prior coefficients that the profile
predicted. With few samples, or samples that say nothing about a coefficient (all
trees small, so the compute slope is never seen), the prior holds; with many
consistent samples the data wins. Pure numpy-free Python: the systems are 1x1 and 2x2.
"""

from __future__ import annotations

from typing import Iterable, Sequence

# How many samples' worth of confidence the prior carries (per coefficient).
PRIOR_WEIGHT = 0.25
_EPS = 1e-6  # seconds: the scale for a prior coefficient of zero
MAX_SPLITS = 12


def _solve_line(
    xs: Sequence[float], ys: Sequence[float], prior: tuple[float, float], weight: float
) -> tuple[float, float]:
    """Fit y = a + b*x minimising sum(((y - a - b x)/y)^2) + ridge toward prior (a0, b0)."""
    a0, b0 = prior
    # Ridge terms in relative units: weight * ((a - a0) / sa)^2. The scale is the prior
    # or the data's own magnitude, whichever is larger, so that a prior that is off by
    # orders of magnitude (a guessed overhead) cannot outvote the measurements.
    y_mean = sum(ys) / len(ys)
    x_mean = max(sum(xs) / len(xs), 1e-9)
    ra = weight / max(abs(a0), y_mean, _EPS) ** 2
    rb = weight / max(abs(b0), y_mean / x_mean, _EPS) ** 2
    saa, sab, sbb, sa, sb = ra, 0.0, rb, ra * a0, rb * b0
    for x, y in zip(xs, ys):
        w = 1.0 / max(y, _EPS) ** 2
        saa += w
        sab += w * x
        sbb += w * x * x
        sa += w * y
        sb += w * x * y
    det = saa * sbb - sab * sab
    if abs(det) < 1e-30:
        return a0, b0
    a = (sa * sbb - sb * sab) / det
    b = (saa * sb - sab * sa) / det
    return max(a, 0.0), max(b, 0.0)


def fit_line(
    samples: Iterable[tuple[float, float]], prior: tuple[float, float], weight: float = PRIOR_WEIGHT
) -> tuple[float, float]:
    """(a, b) of y = a + b*x from (x, y) samples, pulled toward `prior`."""
    pts = [(float(x), float(y)) for x, y in samples if y > 0]
    if not pts:
        return prior
    xs, ys = zip(*pts)
    return _solve_line(xs, ys, prior, weight)


def fit_hinge(
    samples: Iterable[tuple[float, float]],
    prior: tuple[float, float, float],
    weight: float = PRIOR_WEIGHT,
) -> tuple[float, float, float]:
    """(flat, base, slope) of y = max(flat, base + slope*x) from (x, y) samples.

    Tries splits of the samples (sorted by x) into a flat part and a sloped part,
    fits each by weighted ridge least squares, and keeps the split with the least
    total cost. Splits are taken at up to MAX_SPLITS evenly spaced ranks: the policy
    refits every few steps, and every split would cost a few ms of Python each time.
    """
    pts = sorted((float(x), float(y)) for x, y in samples if y > 0)
    if not pts:
        return prior
    y_mean = sum(y for _, y in pts) / len(pts)
    x_mean = max(sum(x for x, _ in pts) / len(pts), 1e-9)
    best: tuple[float, tuple[float, float, float]] | None = None
    n = len(pts)
    splits = sorted({round(i * n / MAX_SPLITS) for i in range(MAX_SPLITS + 1)}) if n > MAX_SPLITS else range(n + 1)
    for k in splits:
        flat_part, slope_part = pts[:k], pts[k:]
        flat = fit_constant([y for _, y in flat_part], prior[0], weight, y_mean)
        if slope_part:
            xs, ys = zip(*slope_part)
            base, slope = _solve_line(xs, ys, prior[1:], weight)
        else:
            base, slope = prior[1], prior[2]
        coef = (flat, base, slope)
        cost = _cost(pts, coef, prior, weight, (y_mean, y_mean, y_mean / x_mean))
        if best is None or cost < best[0]:
            best = (cost, coef)
    return best[1]


def fit_plane(samples: Iterable[tuple[float, float, float]], prior: tuple[float, float, float],
              weight: float = PRIOR_WEIGHT) -> tuple[float, float, float]:
    """(a, b, c) >= 0 of y = a + b*x + c*z from (x, z, y) samples: least squares on
    relative error with a ridge toward `prior`, as _solve_line does for a line."""
    pts = [(1.0, float(x), float(z), float(y)) for x, z, y in samples if y > 0]
    if not pts:
        return prior
    y_mean = sum(p[3] for p in pts) / len(pts)
    scales = [max(abs(p0), y_mean / max(sum(p[i] for p in pts) / len(pts), 1e-9), _EPS)
              for i, p0 in enumerate(prior)]
    m = [[weight / scales[i] ** 2 if i == j else 0.0 for j in range(3)] for i in range(3)]
    v = [weight * prior[i] / scales[i] ** 2 for i in range(3)]
    for *row, y in pts:
        w = 1.0 / y**2
        for i in range(3):
            v[i] += w * row[i] * y
            for j in range(3):
                m[i][j] += w * row[i] * row[j]
    solved = _solve3(m, v)
    return prior if solved is None else tuple(max(c, 0.0) for c in solved)  # type: ignore[return-value]


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    """m x = v for a 3x3 system (Gaussian elimination with partial pivoting)."""
    a = [row[:] + [b] for row, b in zip(m, v)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-30:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            for c in range(col, 4):
                a[r][c] -= f * a[col][c]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (a[r][3] - sum(a[r][c] * x[c] for c in range(r + 1, 3))) / a[r][r]
    return x


def fit_constant(ys: Sequence[float], prior: float, weight: float, scale: float) -> float:
    r = weight / max(prior, scale, _EPS) ** 2
    num, den = r * prior, r
    for y in ys:
        num += 1.0 / y
        den += 1.0 / y**2
    return num / den


def _cost(pts, coef, prior, weight, scales) -> float:
    flat, base, slope = coef
    cost = sum(((y - max(flat, base + slope * x)) / y) ** 2 for x, y in pts)
    for value, p0, scale in zip(coef, prior, scales):
        cost += weight * ((value - p0) / max(abs(p0), scale, _EPS)) ** 2
    return cost
