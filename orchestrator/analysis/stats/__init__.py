"""Regression analysis as pure functions over plain data: no database, no SQLAlchemy. The store
fetches samples and writes Alert rows; the CLI and the nightly analysis call these.

API (docs/regression.md has the method and its measured quality):

    SeriesKey(device, os_driver, model, resolution, steps, precision, profile, metric,
              environment="")
        .canonical() -> str             canonical JSON, SeriesSetting.series_key
        .parse(text) -> SeriesKey        its inverse;  .as_dict() for Alert.series
        .in_any_environment()            os_driver and environment left open (settings)
    check_series(samples: Iterable[SeriesSample], *, flagged_runs=(), include_flagged=False)
        -> CheckedSeries(key, unit, values, excluded_runs)
        ValueError on mixed keys, mixed units or non-finite values; samples of flagged runs
        are left out unless include_flagged.
    compare(baseline, candidate, *, baseline_runs=None, candidate_runs=None, drift=0.01,
            min_effect=0.03, higher_is_worse=True, alpha=0.01, confidence=0.95, n_boot=2000,
            seed=0, min_samples=5, max_repetitions=40)
        -> Comparison(verdict, cause, reason, medians, ratio, ci_low, ci_high, p_value,
                      p_mannwhitney, p_min, p_drift, runs_*, more_repetitions_suggested, ...)
        verdict in "regression" | "improvement" | "same" | "inconclusive". The interval is a
        percentile bootstrap of median(candidate) / median(baseline) widened by the series'
        run-to-run drift over the runs each build has (samples labelled by run); p is the
        larger of the two-sided Mann-Whitney U p and the drift-aware normal test of log
        ratio. A change is called only when p <= alpha AND the ratio lies beyond 1 +/-
        min_effect; "same" when the whole interval lies inside that band; fewer than
        min_samples in either build is always "inconclusive". An inconclusive verdict says
        its cause: too_few, unreachable (p_min, the smallest p the sample counts allow, is
        above alpha, and the reason says how many samples can), not_significant, drift or
        within_effect. When inconclusive, more_repetitions_suggested (> 0) is the size of one
        more run of each build (at least what makes p <= alpha reachable), bounded so that no
        build exceeds max_repetitions; 0 there means the verdict is final.
    estimate_drift(runs, *, min_runs=6) -> float | None
        a series' run-to-run drift from its history (one sample array per run, in order);
        = drift_from_spreads([run_spread(run) for run in runs]), the form the analysis keeps.
    detect_change_points(history, *, min_segment=3, sig_level=0.01, n_permutations=199,
                         seed=0) -> list[ChangePoint(index, p_value, q, median_before,
                                                     median_after, ratio)]
        E-Divisive with a permutation test on per-build values (or sample groups, reduced to
        their medians), in build order.
    attribute(baseline, candidate, *, top=10) -> list[KernelMove(kernel, baseline_ms,
                                                  candidate_ms, delta_ms, share)]
        per-kernel total ms per repetition in, movers sorted by |delta_ms| out.
    psnr(a, b) -> float;  compare_images(previous, current, *, min_psnr_db=30.0)
        -> ImageCheck(psnr_db, changed)   uint8 (H, W, 3) arrays or PNG paths; inf if equal.
    thermal_flag(*, cooldown_timed_out, readings=(), throttle_celsius=85.0,
                 max_start_celsius=None) -> ThermalFlag(flagged, reasons, hottest_before,
                                                        hottest_after)

Comparisons exclude flagged runs by default: flag each run with thermal_flag(), pass the
flagged run ids to check_series(), and compare() the values it returns.
"""

from orchestrator.analysis.stats.attribution import KernelMove, attribute
from orchestrator.analysis.stats.changepoint import ChangePoint, detect_change_points
from orchestrator.analysis.stats.compare import (
    DEFAULT_DRIFT,
    SAMPLE_LIMITED,
    Cause,
    Comparison,
    Verdict,
    compare,
    drift_from_spreads,
    estimate_drift,
    min_rank_p,
    run_spread,
)
from orchestrator.analysis.stats.fidelity import ImageCheck, compare_images, load_image, psnr
from orchestrator.analysis.stats.series import CheckedSeries, SeriesKey, SeriesSample, check_series
from orchestrator.analysis.stats.thermal import ThermalFlag, ThermalReading, thermal_flag

__all__ = [
    "DEFAULT_DRIFT",
    "SAMPLE_LIMITED",
    "Cause",
    "ChangePoint",
    "CheckedSeries",
    "Comparison",
    "ImageCheck",
    "KernelMove",
    "SeriesKey",
    "SeriesSample",
    "ThermalFlag",
    "ThermalReading",
    "Verdict",
    "attribute",
    "check_series",
    "compare",
    "compare_images",
    "detect_change_points",
    "drift_from_spreads",
    "estimate_drift",
    "load_image",
    "min_rank_p",
    "psnr",
    "run_spread",
    "thermal_flag",
]
