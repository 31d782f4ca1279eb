"""A new build's samples against its baseline's on one series: medians, the ratio of medians
with a confidence interval, rank-test and drift-aware p-values, and a verdict that only calls a
change when it is significant and larger than the series' minimum effect.

Repetitions of one run (one night's session of one build on one device) share that run's
conditions, so they are not independent of each other: a whole run sits higher or lower than
the next by a run-to-run drift that more repetitions in the same run never average away. The
rank tests and the bootstrap see only the repetitions; the drift term adds the runs' share.

Notation:
    b, c       baseline and candidate samples (one series, one unit), n_b and n_c of them,
               from k_b and k_c runs
    r          median(c) / median(b); r > 1 means the candidate's values are larger
    d          run-to-run drift: the standard deviation of a run's log level (0.01 is 1%),
               from the series' history (estimate_drift) or DEFAULT_DRIFT
    s_boot     bootstrap standard error of log r (repetitions resampled within each build)
    s          sqrt(s_boot^2 + d^2 (1/k_b + 1/k_c)): the standard error of log r with drift
    [lo, hi]   percentile-bootstrap interval of log r, each side widened by z d sqrt(1/k_b +
               1/k_c) in quadrature (z for `confidence`), back on the ratio scale
    m          the minimum effect: changes inside [1 - m, 1 + m] do not matter
    p_rank     Mann-Whitney U, two-sided (exact without ties below 8 samples a build, else
               the normal approximation, as scipy chooses)
    p_min      the smallest p_rank n_b and n_c samples can give (every candidate sample beyond
               every baseline one): 2 / C(n_b + n_c, n_b) when exact. When p_min > alpha no
               data can make a change significant, so the comparison asks for the samples
               that can instead of reporting a verdict it could never reach
    p_drift    two-sided normal p of log r / s
    p          max(p_rank, p_drift): significant only when both tests say so

Why one rank test: taking the smaller of Mann-Whitney and Kolmogorov-Smirnov needs a factor of
2 (Bonferroni), and 2 x 2 / C(10, 5) = 0.016 put every 5-against-5 comparison out of reach of
alpha 0.01, however large the change (a 3x slowdown read "inconclusive"). Kolmogorov-Smirnov
adds nothing the verdict uses: the verdict is about the ratio of medians, and a shift of that
is what Mann-Whitney detects best. docs/regression.md has the simulated false-positive rate
and power of this test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats

Verdict = Literal["regression", "improvement", "same", "inconclusive"]
# Why a verdict is what it is: "decided" (regression, improvement, same) or, for an
# inconclusive one, the cause that applied. "too_few" and "unreachable" are about the sample
# count, not the data: more samples always help them, so every such metric gets a
# more-repetitions round (orchestrator/analysis/regressions.py), whatever metrics the batch rounds on.
Cause = Literal["decided", "too_few", "unreachable", "not_significant", "drift", "within_effect"]
SAMPLE_LIMITED: tuple[Cause, ...] = ("too_few", "unreachable")

MIN_SAMPLES = 5
MAX_REPETITIONS = 40
DEFAULT_DRIFT = 0.01  # run-to-run drift assumed for a series without enough history (1%)
MIN_HISTORY_RUNS = 6  # runs of history estimate_drift() needs before it replaces the default


@dataclass(frozen=True)
class Comparison:
    verdict: Verdict
    reason: str  # one line saying why this verdict
    cause: Cause
    n_baseline: int
    n_candidate: int
    baseline_median: float | None
    candidate_median: float | None
    ratio: float | None  # candidate median / baseline median
    ci_low: float | None
    ci_high: float | None
    confidence: float
    p_value: float | None  # max(p_rank, p_drift)
    p_mannwhitney: float | None
    p_min: float | None  # the smallest p_mannwhitney these sample counts can give
    p_drift: float | None
    runs_baseline: int
    runs_candidate: int
    drift: float
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
) -> tuple[float, float, float]:
    """(lo, hi, s_boot): the percentile interval of median(c*) / median(b*), each build
    resampled on its own, and the standard deviation of log of that ratio over the resamples."""
    rng = np.random.default_rng(seed)
    mb = np.median(b[rng.integers(0, b.size, (n_boot, b.size))], axis=1)  # (n_boot,)
    mc = np.median(c[rng.integers(0, c.size, (n_boot, c.size))], axis=1)  # (n_boot,)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(mb > 0, mc / mb, np.inf)
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(r, [tail, 1.0 - tail])
    finite = r[np.isfinite(r) & (r > 0)]
    s_boot = float(np.std(np.log(finite))) if finite.size > 1 else math.inf
    return float(lo), float(hi), s_boot


def _run_count(labels: Sequence | None, n: int, name: str) -> int:
    if labels is None:
        return 1
    if len(labels) != n:
        raise ValueError(f"{name}: {len(labels)} run labels for {n} samples")
    return max(1, len(set(labels)))


def estimate_drift(runs: Sequence[Sequence[float]], *, min_runs: int = MIN_HISTORY_RUNS) -> float | None:
    """The run-to-run drift d of a series from its history: one sample array per run, in
    order. Consecutive runs' log medians differ by drift (twice) plus each median's own
    sampling noise; d^2 = (c MAD of those differences)^2 / 2 - the mean variance of a run
    median (pi/2 * (1.4826 MAD of the run's log samples)^2 / n), at least 0, with c = 1.4826
    k / (k - 0.8) for k differences. MAD-based, so a
    real step or a thermal outlier among the runs moves it little. None with fewer than
    `min_runs` runs of at least 3 samples each."""
    return drift_from_spreads([run_spread(r) for r in runs], min_runs=min_runs)


def run_spread(run: Sequence[float]) -> tuple[float, float] | None:
    """What estimate_drift needs of one run: (its log median, the variance of that median:
    pi/2 * (1.4826 MAD of its log samples)^2 / n); None for a run it cannot use (fewer than 3
    samples, or a sample at 0). The analysis keeps this per run (series_runs), so that a drift
    estimate reads no raw samples."""
    if len(run) < 3:
        return None
    x = np.log(_check_values("run", run))
    if not np.all(np.isfinite(x)):
        return None
    return float(np.median(x)), float((math.pi / 2) * (1.4826 * np.median(np.abs(x - np.median(x)))) ** 2 / x.size)


def drift_from_spreads(spreads: Sequence[tuple[float, float] | None], *,
                       min_runs: int = MIN_HISTORY_RUNS) -> float | None:
    """estimate_drift over runs already reduced by run_spread (None: a run it cannot use)."""
    usable = [s for s in spreads if s is not None]
    if len(usable) < min_runs:
        return None
    diffs = np.diff(np.array([median for median, _ in usable]))  # (k - 1,)
    # 1.4826 makes a MAD a normal standard deviation as n grows; k / (k - 0.8) undoes most of
    # its downward bias on few values (Croux and Rousseeuw's small-sample factor).
    spread = 1.4826 * diffs.size / (diffs.size - 0.8) * np.median(np.abs(diffs - np.median(diffs)))
    within = np.mean([w for _, w in usable])
    return float(math.sqrt(max(0.0, spread**2 / 2 - within)))


def rank_p_value(b: np.ndarray, c: np.ndarray) -> float:
    """Mann-Whitney U, two-sided; 1 when every value is equal (no evidence of any difference)."""
    if np.ptp(np.concatenate([b, c])) == 0:
        return 1.0
    return float(stats.mannwhitneyu(b, c, alternative="two-sided").pvalue)


def min_rank_p(n_b: int, n_c: int) -> float:
    """The smallest p rank_p_value can give with n_b and n_c samples: its p when every
    candidate sample lies beyond every baseline sample (the test picks exact or asymptotic
    from the counts alone when there are no ties)."""
    if n_b < 1 or n_c < 1:
        return 1.0
    return rank_p_value(np.arange(n_b, dtype=float), np.arange(n_b, n_b + n_c, dtype=float))


def samples_for(alpha: float, n_b: int, n_c: int, limit: int = MAX_REPETITIONS) -> tuple[int, int] | None:
    """The fewest samples (each build adding the same number) whose min_rank_p is at most
    alpha; None when not even `limit` a build would do."""
    for extra in range(0, limit + 1):
        if max(n_b, n_c) + extra > limit:
            return None
        if min_rank_p(n_b + extra, n_c + extra) <= alpha:
            return n_b + extra, n_c + extra
    return None


def _more_repetitions(n: int, per_run: int, *, max_repetitions: int) -> int:
    """Repetitions to add to each build: one more run of the size the builds' runs have had
    (run-to-run drift, which dominates, averages only over runs), never beyond
    `max_repetitions` in all; 0 when there is no room left (the verdict is then final)."""
    room = max_repetitions - n
    return max(0, min(room, max(MIN_SAMPLES, per_run)))


def _decidable(log_r: float, s_boot: float, drift: float, k_b: int, k_c: int, n: int, per_run: int, runs: int,
               z: float, alpha: float, m: float) -> bool:
    """Whether `runs` more runs of each build could decide a comparison whose log ratio stays
    as it is: the drift's share of the error shrinks with the runs, the repetitions' share
    with the samples they add (`per_run` a run, to the `n` there are). Decided: a change
    beyond the minimum effect significant at alpha, or the whole interval inside 1 +/- m."""
    if runs <= 0 or not math.isfinite(log_r):
        return runs > 0
    s_reps = s_boot * math.sqrt(n / (n + runs * max(1, per_run)))
    s = math.sqrt(s_reps**2 + drift**2 * (1.0 / (k_b + runs) + 1.0 / (k_c + runs)))
    z_alpha = float(stats.norm.isf(alpha / 2.0))
    change = abs(log_r) > z_alpha * s and abs(math.expm1(log_r)) > m
    # the band is 1 +/- m in the ratio, so it is wider below 1 than above it in log terms: a
    # faster candidate is held to its own side (the mirror image of r = 0.88 against 1.25,
    # not 0.75, refused the rounds that would have made b1 against itself "same")
    same = log_r + z * s < math.log1p(m) and log_r - z * s > math.log1p(-m)
    return change or same


def compare(
    baseline: Sequence[float],
    candidate: Sequence[float],
    *,
    baseline_runs: Sequence | None = None,
    candidate_runs: Sequence | None = None,
    drift: float = DEFAULT_DRIFT,
    min_effect: float = 0.03,
    higher_is_worse: bool = True,
    alpha: float = 0.01,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
    min_samples: int = MIN_SAMPLES,
    max_repetitions: int = MAX_REPETITIONS,
    runs_left: int | None = None,
) -> Comparison:
    """Compare a candidate build's samples with its baseline's on one series (same key, same
    unit: check_series() first). `baseline_runs` / `candidate_runs` label each sample with its
    run (any hashable; None: all from one run); `drift` is the series' run-to-run drift.
    Verdicts:
      regression / improvement  p <= alpha (rank tests and drift-aware test) and r beyond
                                1 + m (or below 1 - m), worse or better per `higher_is_worse`
      same                      the whole interval [lo, hi] lies inside [1 - m, 1 + m]
      inconclusive              anything else, and always with fewer than `min_samples` in
                                either build; more_repetitions_suggested says how many more
                                (from a new run of each build: only new runs average drift)
    `runs_left`: how many more runs of each build may still come (a batch's rounds left; None:
    no limit). When even that many could not decide the comparison (its ratio and errors as
    they are, the drift's share shrinking with the runs), no more are asked for and the reason
    says so: a round that cannot change the verdict only costs device time.
    Deterministic: the bootstrap draws from numpy's default_rng(seed)."""
    if not 0 <= min_effect < 1:
        raise ValueError(f"min_effect must be in [0, 1), got {min_effect!r} (0.03 means 3%)")
    if not 0 < alpha < 1 or not 0 < confidence < 1:
        raise ValueError(f"alpha and confidence must be in (0, 1), got {alpha!r}, {confidence!r}")
    if not 0 <= drift < 1 or not math.isfinite(drift):
        raise ValueError(f"drift must be in [0, 1), got {drift!r} (0.01 means 1% run to run)")
    b = _check_values("baseline", baseline)
    c = _check_values("candidate", candidate)
    k_b = _run_count(baseline_runs, b.size, "baseline")
    k_c = _run_count(candidate_runs, c.size, "candidate")
    m = min_effect
    common = dict(
        n_baseline=int(b.size), n_candidate=int(c.size), runs_baseline=k_b, runs_candidate=k_c,
        drift=drift, confidence=confidence, alpha=alpha, min_effect=m, higher_is_worse=higher_is_worse,
    )
    med_b = float(np.median(b)) if b.size else None
    med_c = float(np.median(c)) if c.size else None
    n = min(b.size, c.size)

    p_min = min_rank_p(b.size, c.size)

    # 1. Too few samples: no statistics, ask for enough to start.
    if n < min_samples:
        ratio = med_c / med_b if med_b and med_c is not None else None
        want = max(min_samples, *(samples_for(alpha, b.size, c.size, max_repetitions) or (0,)))
        return Comparison(
            verdict="inconclusive", cause="too_few",
            reason=f"too few samples ({b.size} baseline, {c.size} candidate; {min_samples} needed)",
            baseline_median=med_b, candidate_median=med_c, ratio=ratio, ci_low=None, ci_high=None,
            p_value=None, p_mannwhitney=None, p_min=p_min, p_drift=None,
            more_repetitions_suggested=max(0, min(want, max_repetitions) - n), **common,
        )
    if med_b <= 0:
        raise ValueError(f"baseline median is {med_b}: the ratio of medians is undefined")

    # 2. Effect size and its interval: the bootstrap's, widened by the runs' drift.
    r = med_c / med_b
    boot_lo, boot_hi, s_boot = bootstrap_ratio_ci(b, c, confidence=confidence, n_boot=n_boot, seed=seed)
    runs_var = drift**2 * (1.0 / k_b + 1.0 / k_c)
    z = float(stats.norm.ppf(0.5 + confidence / 2.0))
    log_r = math.log(r) if r > 0 else -math.inf
    lo, hi = boot_lo, boot_hi
    if math.isfinite(log_r) and boot_lo > 0 and math.isfinite(boot_hi):
        lo = math.exp(log_r - math.hypot(log_r - math.log(boot_lo), z * math.sqrt(runs_var)))
        hi = math.exp(log_r + math.hypot(math.log(boot_hi) - log_r, z * math.sqrt(runs_var)))

    # 3. Significance: the rank test on the repetitions, and log r against its drift-aware error.
    p_mw = rank_p_value(b, c)
    s_total = math.sqrt(s_boot**2 + runs_var)
    if s_total > 0 and math.isfinite(s_total) and math.isfinite(log_r):
        p_drift = float(2.0 * stats.norm.sf(abs(log_r) / s_total))
    else:
        p_drift = 1.0 if log_r == 0 or not math.isfinite(s_total) else 0.0
    p = max(p_mw, p_drift)
    significant = p <= alpha

    # 4. Verdict, and for an inconclusive one the cause that applied.
    up, down = significant and r > 1 + m, significant and r < 1 - m
    interval = f"interval [{lo:.4f}, {hi:.4f}]"
    cause: Cause = "decided"
    if up or down:
        verdict: Verdict = "regression" if up == higher_is_worse else "improvement"
        reason = f"p={p:.2g} <= {alpha} and ratio {r:.4f} beyond {'1+' if up else '1-'}{m} ({interval})"
    elif 1 - m <= lo and hi <= 1 + m:
        verdict, reason = "same", f"{interval} within 1 +/- {m}"
    else:
        verdict = "inconclusive"
        if p_min > alpha:
            cause = "unreachable"
            enough = samples_for(alpha, b.size, c.size, max_repetitions)
            reason = (f"{b.size} vs {c.size} samples cannot reach p <= {alpha} (the rank test's smallest p "
                      f"with them is {p_min:.2g}): " + (f"{enough[0]} vs {enough[1]} needed" if enough else
                                                      f"more than {max_repetitions} a build needed"))
        elif significant:
            cause = "within_effect"
            reason = (f"p={p:.2g} <= {alpha}, but ratio {r:.4f} is within 1 +/- {m} while the {interval} "
                      f"leaves that band: not yet known to be smaller than the minimum effect")
        elif p_mw <= alpha:
            cause = "drift"
            reason = (f"ratio {r:.4f} ({interval}): the repetitions differ (rank p={p_mw:.2g}), but {k_b} vs "
                      f"{k_c} runs cannot tell that from run-to-run drift ({drift:.1%} a run; p={p_drift:.2g} "
                      f"with it): more runs of each build can tell them apart")
        else:
            cause = "not_significant"
            reason = f"not significant: p={p:.2g} > {alpha} (rank p={p_mw:.2g}), ratio {r:.4f} ({interval})"

    more = 0
    if verdict == "inconclusive":
        more = _more_repetitions(n, min(b.size, c.size) // max(k_b, k_c), max_repetitions=max_repetitions)
        if cause == "unreachable" and enough:
            more = max(more, max(enough[0] - b.size, enough[1] - c.size))
        elif cause in ("drift", "not_significant", "within_effect") and runs_left is not None and more:
            per_run = min(b.size, c.size) // max(k_b, k_c)
            if not _decidable(log_r, s_boot, drift, k_b, k_c, n, per_run, runs_left, z, alpha, m):
                more = 0
                reason += (f"; {runs_left} more run{'s' if runs_left != 1 else ''} of each build could not decide "
                           f"it either (with {drift:.1%} drift a run): none asked for")
    return Comparison(
        verdict=verdict, cause=cause, reason=reason, baseline_median=med_b, candidate_median=med_c, ratio=r,
        ci_low=lo, ci_high=hi, p_value=p, p_mannwhitney=p_mw, p_min=p_min, p_drift=p_drift,
        more_repetitions_suggested=more, **common,
    )
