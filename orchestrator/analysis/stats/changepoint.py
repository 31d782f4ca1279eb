"""Change points in a series' history: E-Divisive (Matteson and James, 2014) on the per-build
medians, splitting hierarchically at the point that maximises the energy-distance statistic and
keeping a split only when a permutation test with a fixed seed finds it significant. A minimum
segment length keeps single spikes (one throttled night) from making a change point.

Notation:
    x          per-build values in build order (a build's median when given sample groups)
    D[i, j]    |x_i - x_j| (energy distance with exponent 1)
    Q(tau)     m n / (m + n) * (2/(m n) sum_between D - 2/(m(m-1)) sum_left D
               - 2/(n(n-1)) sum_right D), for a segment split into m points before tau and n
               from tau on
    p          (1 + #{permutations with max Q >= observed}) / (1 + n_permutations)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_SEGMENT = 3


@dataclass(frozen=True)
class ChangePoint:
    index: int  # first build of the new segment (position in the history)
    p_value: float
    q: float  # the energy statistic at the split
    median_before: float  # median of the segment that ends at index
    median_after: float  # median of the segment that starts at index
    ratio: float | None  # median_after / median_before


def _as_values(history: Sequence[float] | Sequence[Sequence[float]]) -> np.ndarray:
    values = []
    for i, point in enumerate(history):
        if isinstance(point, (int, float, np.floating, np.integer)):
            values.append(float(point))
        else:
            group = np.asarray(point, dtype=float).ravel()
            if group.size == 0:
                raise ValueError(f"build {i} of the history has no samples")
            values.append(float(np.median(group)))
    x = np.asarray(values, dtype=float)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"history has non-finite values at {np.flatnonzero(~np.isfinite(x)).tolist()}")
    return x


def _best_split(D: np.ndarray, min_segment: int) -> tuple[np.ndarray, np.ndarray]:
    """(tau, Q(tau)) maximising Q over one segment's distance matrix D (..., T, T): for each of
    a stack of segments at once (one per permutation in the significance test). With row sums
    r_i = sum_j D[i, j] and lower row sums l_i = sum_{j<i} D[i, j], the points before tau hold
    2 W(tau) = 2 sum_{i<tau} l_i within, the pairs across are S(tau) - 2 W(tau) with
    S(tau) = sum_{i<tau} r_i, and the points from tau on hold sum r - 2 S(tau) + 2 W(tau)."""
    T = D.shape[-1]
    rows = D.sum(-1)
    lower = (D * np.tri(T, T, -1)).sum(-1)
    zero = np.zeros(D.shape[:-2] + (1,))
    W = np.concatenate([zero, lower.cumsum(-1)], axis=-1)  # W[..., tau]
    S = np.concatenate([zero, rows.cumsum(-1)], axis=-1)
    tau = np.arange(min_segment, T - min_segment + 1)
    m, n = tau.astype(float), (T - tau).astype(float)
    left = 2 * W[..., tau]  # ordered pairs, diagonal 0
    between = S[..., tau] - 2 * W[..., tau]
    right = rows.sum(-1)[..., None] - 2 * S[..., tau] + 2 * W[..., tau]
    q = m * n / (m + n) * (2 * between / (m * n) - left / (m * (m - 1)) - right / (n * (n - 1)))
    k = np.argmax(q, axis=-1)
    return tau[k], np.take_along_axis(q, k[..., None], axis=-1)[..., 0]


PERMUTATION_BLOCK = 25  # permutations tested at once


def detect_change_points(
    history: Sequence[float] | Sequence[Sequence[float]],
    *,
    min_segment: int = MIN_SEGMENT,
    sig_level: float = 0.01,
    n_permutations: int = 199,
    seed: int = 0,
    max_change_points: int | None = None,
) -> list[ChangePoint]:
    """Change points of a history (per-build values, or per-build sample groups reduced to
    their medians), sorted by index. Each split leaves segments of at least `min_segment`
    builds; a split is kept when its permutation p-value is <= `sig_level` (the smallest
    possible p is 1 / (n_permutations + 1)). Deterministic for a given seed."""
    if min_segment < 2:
        raise ValueError(f"min_segment must be >= 2 (a segment needs a spread), got {min_segment}")
    if not 0 < sig_level < 1:
        raise ValueError(f"sig_level must be in (0, 1), got {sig_level!r}")
    x = _as_values(history)
    rng = np.random.default_rng(seed)
    bounds = [0, x.size]
    found: list[tuple[int, float, float]] = []
    while max_change_points is None or len(found) < max_change_points:
        # 1. The best split over every current segment.
        best = None
        for s, e in zip(bounds[:-1], bounds[1:], strict=True):
            if e - s < 2 * min_segment:
                continue
            seg = x[s:e]
            tau, q = _best_split(np.abs(seg[:, None] - seg[None, :]), min_segment)
            if best is None or q > best[2]:
                best = (s, e, float(q), s + int(tau))
        if best is None:
            break
        s, e, q, index = best
        # 2. Its significance: how often a shuffled segment splits as well. The permutations
        # are drawn one by one, as always, and tested a block at a time; the test stops once
        # enough have split as well for p to exceed sig_level whatever the rest do (then the
        # split is dropped and the search ends, so no later draw is skipped).
        seg = x[s:e]
        hits, done = 0, 0
        while done < n_permutations and (1 + hits) / (1 + n_permutations) <= sig_level:
            perms = np.array([rng.permutation(seg) for _ in range(min(PERMUTATION_BLOCK, n_permutations - done))])
            hits += int(np.sum(_best_split(np.abs(perms[:, :, None] - perms[:, None, :]), min_segment)[1] >= q))
            done += len(perms)
        p = (1 + hits) / (1 + n_permutations)
        if p > sig_level:
            break
        found.append((index, p, q))
        bounds = sorted([*bounds, index])
    # 3. Describe each kept split by the segments on either side of it.
    bounds = sorted([0, x.size, *(i for i, _, _ in found)])
    result = []
    for index, p, q in sorted(found):
        k = bounds.index(index)
        before = float(np.median(x[bounds[k - 1]:index]))
        after = float(np.median(x[index:bounds[k + 1]]))
        ratio = after / before if before != 0 else None
        result.append(ChangePoint(index, p, q, before, after, ratio if ratio is None or math.isfinite(ratio) else None))
    return result
