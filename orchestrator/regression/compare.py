"""A new build's samples against its baseline's on one series: medians, the ratio of medians
with a percentile-bootstrap confidence interval, a rank-test p-value, and a verdict that only
calls a change when it is both significant and larger than the series' minimum effect.

Notation:
    b, c       baseline and candidate samples (one series, one unit), n_b and n_c of them
    r          median(c) / median(b); r > 1 means the candidate's values are larger
    [lo, hi]   percentile-bootstrap interval of r at level `confidence`
    m          the minimum effect: changes inside [1 - m, 1 + m] do not matter
    p          min(1, 2 * min(p_MW, p_KS)): Mann-Whitney U and Kolmogorov-Smirnov, both
               two-sided, Bonferroni-corrected for taking the smaller of two tests
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats

Verdict = Literal["regression", "improvement", "same", "inconclusive"]

MIN_SAMPLES = 5
MAX_REPETITIONS = 40


@dataclass(frozen=True)
class Comparison:
    verdict: Verdict
    reason: str  # one line saying why this verdict
    n_baseline: int
    n_candidate: int
    baseline_median: float | None
    candidate_median: float | None
    ratio: float | None  # candidate median / baseline median
    ci_low: float | None
    ci_high: float | None
    confidence: float
    p_value: float | None  # min(1, 2 * min(p_mannwhitney, p_ks))
    p_mannwhitney: float | None
    p_ks: float | None
    alpha: float
    min_effect: float
    higher_is_worse: bool
    # Repetitions to add to each build before comparing again; 0 when decided, or when the
    # builds already have max_repetitions samples (then "inconclusive" is final).
    more_repetitions_suggested: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _check_values(name: str, values: Sequence[float]) -> np.ndarray:
    x = np.asarray(values, dtype=float).ravel()
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} has non-finite values: {x[~np.isfinite(x)][:5].tolist()}")
    if np.any(x < 0):
        raise ValueError(
            f"{name} has negative values {x[x < 0][:5].tolist()}; compare() is for latencies, "
            "byte counts and other non-negative metrics"
        )
    return x


def bootstrap_ratio_ci(
    b: np.ndarray, c: np.ndarray, *, confidence: float, n_boot: int, seed: int
) -> tuple[float, float]:
    """Percentile interval of median(c*) / median(b*), each build resampled on its own."""
    rng = np.random.default_rng(seed)
    mb = np.median(b[rng.integers(0, b.size, (n_boot, b.size))], axis=1)  # (n_boot,)
    mc = np.median(c[rng.integers(0, c.size, (n_boot, c.size))], axis=1)  # (n_boot,)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(mb > 0, mc / mb, np.inf)
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(r, [tail, 1.0 - tail])
    return float(lo), float(hi)


def rank_p_values(b: np.ndarray, c: np.ndarray) -> tuple[float, float, float]:
    """(p, p_MW, p_KS): both tests two-sided, p their Bonferroni-corrected minimum."""
    if np.ptp(np.concatenate([b, c])) == 0:
        return 1.0, 1.0, 1.0  # all values equal: no evidence of any difference
    p_mw = float(stats.mannwhitneyu(b, c, alternative="two-sided").pvalue)
    with warnings.catch_warnings():
        # scipy falls back from the exact to the asymptotic KS distribution on its own for
        # some sizes and says so; the fallback is the intended behaviour here.
        warnings.filterwarnings("ignore", message="ks_2samp: Exact calculation unsuccessful")
        p_ks = float(stats.ks_2samp(b, c, alternative="two-sided").pvalue)
    return min(1.0, 2.0 * min(p_mw, p_ks)), p_mw, p_ks


def _more_repetitions(
    n: int, log_ci: tuple[float, float], log_r: float, m: float, *, min_samples: int, max_repetitions: int
) -> int:
    """Repetitions per build expected to shrink the interval enough to decide: its half-width
    scales as 1/sqrt(n), and it must fit between the estimate and the nearest edge of the
    minimum-effect band. At least `min_samples`, and never beyond `max_repetitions` in all."""
    room = max_repetitions - n
    if room <= 0:
        return 0
    half = (log_ci[1] - log_ci[0]) / 2.0
    edge = min(abs(log_r - math.log1p(m)), abs(log_r - math.log1p(-m)))
    if half <= 0 or not math.isfinite(half):
        needed = n + min_samples
    elif edge <= 1e-12:
        needed = max_repetitions
    else:
        needed = math.ceil(n * (half / edge) ** 2)
    return min(room, max(min_samples, needed - n))


def compare(
    baseline: Sequence[float],
    candidate: Sequence[float],
    *,
    min_effect: float = 0.03,
    higher_is_worse: bool = True,
    alpha: float = 0.01,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
    min_samples: int = MIN_SAMPLES,
    max_repetitions: int = MAX_REPETITIONS,
) -> Comparison:
    """Compare a candidate build's samples with its baseline's on one series (same key, same
    unit: check_series() first). Verdicts:
      regression / improvement  p <= alpha and the whole interval [lo, hi] lies beyond 1 + m
                                (or below 1 - m), worse or better per `higher_is_worse`
      same                      the whole interval lies inside [1 - m, 1 + m]
      inconclusive              anything else, and always with fewer than `min_samples` in
                                either build; more_repetitions_suggested says how many more
    Deterministic: the bootstrap draws from numpy's default_rng(seed)."""
    if not 0 <= min_effect < 1:
        raise ValueError(f"min_effect must be in [0, 1), got {min_effect!r} (0.03 means 3%)")
    if not 0 < alpha < 1 or not 0 < confidence < 1:
        raise ValueError(f"alpha and confidence must be in (0, 1), got {alpha!r}, {confidence!r}")
    b = _check_values("baseline", baseline)
    c = _check_values("candidate", candidate)
    m = min_effect
    common = dict(
        n_baseline=int(b.size), n_candidate=int(c.size), confidence=confidence, alpha=alpha,
        min_effect=m, higher_is_worse=higher_is_worse,
    )
    med_b = float(np.median(b)) if b.size else None
    med_c = float(np.median(c)) if c.size else None
    n = min(b.size, c.size)

    # 1. Too few samples: no statistics, ask for enough to start.
    if n < min_samples:
        ratio = med_c / med_b if med_b and med_c is not None else None
        return Comparison(
            verdict="inconclusive",
            reason=f"too few samples ({b.size} baseline, {c.size} candidate; {min_samples} needed)",
            baseline_median=med_b, candidate_median=med_c, ratio=ratio, ci_low=None, ci_high=None,
            p_value=None, p_mannwhitney=None, p_ks=None,
            more_repetitions_suggested=max(0, min(min_samples, max_repetitions) - n), **common,
        )
    if med_b <= 0:
        raise ValueError(f"baseline median is {med_b}: the ratio of medians is undefined")

    # 2. Effect size and its interval.
    r = med_c / med_b
    lo, hi = bootstrap_ratio_ci(b, c, confidence=confidence, n_boot=n_boot, seed=seed)

    # 3. Significance.
    p, p_mw, p_ks = rank_p_values(b, c)
    significant = p <= alpha

    # 4. Verdict.
    up, down = significant and lo > 1 + m, significant and hi < 1 - m
    if up or down:
        verdict: Verdict = "regression" if up == higher_is_worse else "improvement"
        reason = f"p={p:.2g} <= {alpha} and interval [{lo:.4f}, {hi:.4f}] beyond {'1+' if up else '1-'}{m}"
    elif 1 - m <= lo and hi <= 1 + m:
        verdict, reason = "same", f"interval [{lo:.4f}, {hi:.4f}] within 1 +/- {m}"
    else:
        verdict = "inconclusive"
        reason = f"p={p:.2g}, interval [{lo:.4f}, {hi:.4f}] straddles the +/-{m} band or is not significant"

    more = 0
    if verdict == "inconclusive":
        log_ci = (math.log(lo) if lo > 0 else -math.inf, math.log(hi) if hi > 0 else -math.inf)
        more = _more_repetitions(
            n, log_ci, math.log(r) if r > 0 else -math.inf, m,
            min_samples=min_samples, max_repetitions=max_repetitions,
        )
    return Comparison(
        verdict=verdict, reason=reason, baseline_median=med_b, candidate_median=med_c, ratio=r,
        ci_low=lo, ci_high=hi, p_value=p, p_mannwhitney=p_mw, p_ks=p_ks,
        more_repetitions_suggested=more, **common,
    )
