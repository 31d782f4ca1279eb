"""orchestrator.analysis.stats: the statistics against scipy and numpy references on fresh random
inputs (fixed seeds), the verdicts on clear cases, change points, attribution, PSNR, thermal
flags and the series key."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image
from scipy import stats

import orchestrator.analysis.stats as rg
from orchestrator.analysis.stats import (
    SeriesKey,
    SeriesSample,
    ThermalReading,
    attribute,
    check_series,
    compare,
    compare_images,
    detect_change_points,
    estimate_drift,
    min_rank_p,
    psnr,
    thermal_flag,
)


def latencies(rng: np.random.Generator, n: int, base: float = 100.0, sigma: float = 0.02) -> np.ndarray:
    return base * np.exp(rng.normal(0.0, sigma, n))


def key(**over) -> SeriesKey:
    fields = dict(device="R58M1", os_driver="android-14/adreno-744", model="sd14", resolution="512x512",
                  steps=20, precision="f16", profile="tuned", metric="unet_step_ms")
    return SeriesKey(**{**fields, **over})


# ---- compare ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_p_values_match_scipy(seed):
    rng = np.random.default_rng(seed)
    b, c = latencies(rng, 12), latencies(rng, 15, base=101.5)
    res = compare(b, c)
    p_mw = stats.mannwhitneyu(b, c, alternative="two-sided").pvalue
    assert res.p_mannwhitney == pytest.approx(p_mw, rel=1e-12)
    assert res.p_value == pytest.approx(max(p_mw, res.p_drift), rel=1e-12)
    assert res.baseline_median == pytest.approx(np.median(b))
    assert res.ratio == pytest.approx(np.median(c) / np.median(b))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_drift_term_matches_its_definition(seed):
    """The interval is the bootstrap's widened in quadrature by z d sqrt(1/k_b + 1/k_c) on the
    log scale, and p_drift is the normal p of log r over sqrt(s_boot^2 + d^2 (1/k_b + 1/k_c)),
    with s_boot recomputed here from the same resamples (numpy reference)."""
    rng = np.random.default_rng(seed)
    b, c = latencies(rng, 20), latencies(rng, 30, base=102)
    b_runs, c_runs = [0] * 10 + [1] * 10, [5] * 10 + [6] * 10 + [7] * 10
    no_drift = compare(b, c, baseline_runs=b_runs, candidate_runs=c_runs, drift=0.0)
    res = compare(b, c, baseline_runs=b_runs, candidate_runs=c_runs, drift=0.012)
    assert (res.runs_baseline, res.runs_candidate) == (2, 3)
    extra = stats.norm.ppf(0.975) * 0.012 * math.sqrt(1 / 2 + 1 / 3)
    log_r = math.log(res.ratio)
    assert math.log(res.ci_low) == pytest.approx(log_r - math.hypot(log_r - math.log(no_drift.ci_low), extra))
    assert math.log(res.ci_high) == pytest.approx(log_r + math.hypot(math.log(no_drift.ci_high) - log_r, extra))
    boot = np.random.default_rng(0)  # compare()'s default seed, same draws in the same order
    mb = np.median(b[boot.integers(0, b.size, (2000, b.size))], axis=1)
    mc = np.median(c[boot.integers(0, c.size, (2000, c.size))], axis=1)
    s_boot = np.std(np.log(mc / mb))
    z = abs(log_r) / math.sqrt(s_boot**2 + 0.012**2 * (1 / 2 + 1 / 3))
    assert res.p_drift == pytest.approx(2 * stats.norm.sf(z), rel=1e-9)
    assert res.p_drift > no_drift.p_drift  # drift only ever weakens the evidence


def test_run_to_run_drift_is_not_mistaken_for_a_change():
    """Two single runs whose levels differ by a 4% drift (no change between the builds): the
    repetitions alone make it overwhelmingly significant, the drift-aware test does not."""
    rng = np.random.default_rng(21)
    b, c = latencies(rng, 20, sigma=0.01), latencies(rng, 20, base=104, sigma=0.01)
    assert compare(b, c, drift=0.0).verdict == "regression"
    res = compare(b, c, drift=0.02)
    assert res.p_mannwhitney < 1e-6 and res.p_drift > 0.01
    assert res.verdict == "inconclusive" and res.more_repetitions_suggested == 20  # one more run of each


def test_estimate_drift_recovers_the_run_to_run_spread():
    rng = np.random.default_rng(8)
    for drift in (0.005, 0.01, 0.03):
        runs = [100 * math.exp(rng.normal(0, drift)) * np.exp(rng.normal(0, 0.02, 10)) for _ in range(400)]
        assert estimate_drift(runs) == pytest.approx(drift, rel=0.25)
    steady = [latencies(rng, 10) for _ in range(30)]
    stepped = steady[:15] + [1.2 * r for r in steady[15:]]  # one real change among the runs
    assert estimate_drift(stepped) == pytest.approx(estimate_drift(steady), abs=0.003)
    assert estimate_drift(steady[:5]) is None  # too little history: the caller uses the default
    with pytest.raises(ValueError, match="non-finite"):
        estimate_drift([[1.0, 2.0, math.inf]] * 6)


def test_bootstrap_interval_is_deterministic_and_brackets_the_ratio():
    rng = np.random.default_rng(7)
    b, c = latencies(rng, 10), latencies(rng, 10, base=104)
    first, again, other = compare(b, c, seed=5), compare(b, c, seed=5), compare(b, c, seed=6)
    assert (first.ci_low, first.ci_high) == (again.ci_low, again.ci_high)
    assert (first.ci_low, first.ci_high) != (other.ci_low, other.ci_high)
    assert first.ci_low <= first.ratio <= first.ci_high
    wide = compare(b, c, seed=5, confidence=0.99)
    assert wide.ci_low <= first.ci_low and wide.ci_high >= first.ci_high


def test_clear_ten_percent_shift_is_a_regression():
    rng = np.random.default_rng(11)
    b, c = latencies(rng, 10), latencies(rng, 10, base=110)
    res = compare(b, c)
    assert res.verdict == "regression", res.reason
    assert res.ci_low > 1.03 and res.p_value <= 0.01 and res.more_repetitions_suggested == 0
    # A throughput-like metric (higher is better) reads the same data as an improvement.
    assert compare(b, c, higher_is_worse=False).verdict == "improvement"
    assert compare(c, b).verdict == "improvement"


def test_a_a_is_never_a_change():
    verdicts = set()
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        verdicts.add(compare(latencies(rng, 10), latencies(rng, 10)).verdict)
    assert verdicts <= {"same", "inconclusive"}
    rng = np.random.default_rng(5)
    assert compare(latencies(rng, 30, sigma=0.01), latencies(rng, 30, sigma=0.01)).verdict == "same"


def test_too_few_samples_is_inconclusive_never_a_guess():
    b = [100.0, 101.0, 99.0]
    c = [150.0, 151.0, 149.0]  # an obvious change, but three samples decide nothing
    res = compare(b, c)
    assert res.verdict == "inconclusive"
    assert res.p_value is None and res.ci_low is None
    assert res.more_repetitions_suggested == 2  # up to min_samples
    assert res.ratio == pytest.approx(1.5)


@pytest.mark.parametrize("n", [5, 6, 7, 8, 10])
def test_a_threefold_slowdown_is_a_regression_from_five_samples_a_build(n):
    """The issue's demo case: e2e 3x slower on 5 samples against 5 was "inconclusive" because
    the doubled minimum of two rank tests could not go below 0.016 > alpha with 5 vs 5."""
    rng = np.random.default_rng(40 + n)
    res = compare(latencies(rng, n, sigma=0.05), latencies(rng, n, base=300, sigma=0.05))
    assert res.verdict == "regression" and res.cause == "decided", res.reason


def test_smallest_reachable_p_is_the_exact_rank_tests_and_is_checked_before_a_verdict():
    # Exact Mann-Whitney without ties: 2 / C(n_b + n_c, n_b) when the samples are fully separated.
    for n_b, n_c in [(3, 3), (4, 5), (5, 5), (5, 7), (6, 6)]:
        assert min_rank_p(n_b, n_c) == pytest.approx(2 / math.comb(n_b + n_c, n_b), rel=1e-12)
    rng = np.random.default_rng(9)
    b, c = latencies(rng, 5, sigma=0.01), latencies(rng, 5, base=300, sigma=0.01)
    res = compare(b, c, alpha=0.001)  # 5 vs 5 can reach 0.0079 at best
    assert res.verdict == "inconclusive" and res.cause == "unreachable"
    assert res.p_min == pytest.approx(2 / 252) and "5 vs 5 samples cannot reach p <= 0.001" in res.reason
    assert "7 vs 7 needed" in res.reason and res.more_repetitions_suggested >= 2
    more = compare(np.concatenate([b, latencies(rng, 2, sigma=0.01)]),
                   np.concatenate([c, latencies(rng, 2, base=300, sigma=0.01)]), alpha=0.001)
    assert more.verdict == "regression", more.reason  # the samples it asked for decide it
    final = compare(b, c, alpha=0.001, max_repetitions=5)
    assert final.more_repetitions_suggested == 0 and "more than 5 a build needed" in final.reason


def test_each_inconclusive_verdict_names_its_cause():
    rng = np.random.default_rng(12)
    b = latencies(rng, 10, sigma=0.05)
    same_level = compare(b, latencies(rng, 10, sigma=0.05))
    assert same_level.cause in ("not_significant", "decided") and (same_level.cause == "decided") == \
        (same_level.verdict == "same")
    if same_level.cause == "not_significant":
        assert same_level.reason.startswith("not significant: p=")
    drifted = compare(latencies(rng, 20, sigma=0.01), latencies(rng, 20, base=104, sigma=0.01), drift=0.02)
    assert drifted.cause == "drift" and "run-to-run drift" in drifted.reason
    small = compare(latencies(rng, 40, sigma=0.01), latencies(rng, 40, base=102.8, sigma=0.01), drift=0.0)
    assert small.verdict == "inconclusive" and small.cause == "within_effect", small.reason
    assert compare([1.0, 2.0], [3.0, 4.0]).cause == "too_few"


def test_more_repetitions_are_one_more_run_and_bounded():
    rng = np.random.default_rng(3)
    b, c = latencies(rng, 10, sigma=0.05), latencies(rng, 10, base=103, sigma=0.05)
    res = compare(b, c, max_repetitions=40)
    assert res.verdict == "inconclusive"
    assert res.more_repetitions_suggested == 10  # a new run the size of the first
    assert compare(b, c, max_repetitions=14).more_repetitions_suggested == 4  # up to the bound
    assert compare(b, c, max_repetitions=10).more_repetitions_suggested == 0  # final


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="non-finite"):
        compare([1.0] * 5 + [math.nan], [1.0] * 6)
    with pytest.raises(ValueError, match="min_effect"):
        compare([1.0] * 6, [1.0] * 6, min_effect=3)
    with pytest.raises(ValueError, match="drift"):
        compare([1.0] * 6, [1.0] * 6, drift=-0.1)
    with pytest.raises(ValueError, match="run labels"):
        compare([1.0] * 6, [1.0] * 6, baseline_runs=[0] * 5)


# ---- series -------------------------------------------------------------------------------


def test_series_key_canonical_round_trip():
    k = key()
    text = k.canonical()
    assert SeriesKey.parse(text) == k
    assert " " not in text and text.index('"device"') < text.index('"metric"')
    with pytest.raises(ValueError, match="missing"):
        SeriesKey.parse('{"device": "x"}')
    with pytest.raises(ValueError, match="steps"):
        key(steps="20")


def test_mixed_units_and_keys_are_refused():
    with pytest.raises(ValueError, match="mixes units"):
        check_series([SeriesSample(key(), "ms", 10.0), SeriesSample(key(), "s", 0.01)])
    with pytest.raises(ValueError, match="different series"):
        check_series([SeriesSample(key(), "ms", 10.0), SeriesSample(key(profile="reference"), "ms", 12.0)])


def test_flagged_runs_are_left_out_by_default():
    samples = [SeriesSample(key(), "ms", v, run_id=r) for r, v in [(1, 10.0), (1, 11.0), (2, 30.0)]]
    kept = check_series(samples, flagged_runs={2})
    assert kept.values == (10.0, 11.0) and kept.excluded_runs == (2,)
    assert check_series(samples, flagged_runs={2}, include_flagged=True).values == (10.0, 11.0, 30.0)


# ---- change points ------------------------------------------------------------------------


def test_change_point_found_at_a_real_step():
    rng = np.random.default_rng(21)
    history = np.r_[latencies(rng, 14, sigma=0.01), latencies(rng, 12, base=106, sigma=0.01)]
    cps = detect_change_points(history)
    assert [cp.index for cp in cps] == [14]
    assert cps[0].p_value <= 0.01 and cps[0].ratio == pytest.approx(1.06, abs=0.01)
    assert detect_change_points(history) == cps  # deterministic


def test_sample_groups_are_reduced_to_medians():
    rng = np.random.default_rng(22)
    groups = [latencies(rng, 10, base=100 if i < 10 else 110) for i in range(20)]
    assert [cp.index for cp in detect_change_points(groups)] == [10]


def test_no_change_point_for_single_spikes_or_flat_series():
    for seed in range(5):
        rng = np.random.default_rng(30 + seed)
        flat = latencies(rng, 30, sigma=0.01)
        assert detect_change_points(flat) == []
        spiky = flat.copy()
        spiky[[8, 20]] *= 2.0  # two isolated throttled nights
        assert detect_change_points(spiky) == []
    end = latencies(np.random.default_rng(40), 20, sigma=0.01)
    end[-2:] *= 1.5  # a step in the last two builds is shorter than a segment: not yet called
    assert detect_change_points(end) == []


# ---- attribution --------------------------------------------------------------------------


def test_attribution_shares_and_order():
    rng = np.random.default_rng(50)
    base = {"attention": 40.0, "conv2d": 30.0, "groupnorm": 5.0, "gelu": 2.0}
    after = {"attention": 55.0, "conv2d": 36.0, "groupnorm": 4.0, "gelu": 2.0, "naive_softmax": 3.0}
    b = {k: v * np.exp(rng.normal(0, 0.005, 5)) for k, v in base.items()}
    c = {k: v * np.exp(rng.normal(0, 0.005, 5)) for k, v in after.items()}
    moves = attribute(b, c, top=None)
    assert [m.kernel for m in moves[:3]] == ["attention", "conv2d", "naive_softmax"]
    for m in moves:
        ref_b = np.median(b[m.kernel]) if m.kernel in b else 0.0
        assert m.delta_ms == pytest.approx(np.median(c[m.kernel]) - ref_b)
    movers = [m for m in moves if m.delta_ms > 0]
    assert sum(m.share for m in movers) == pytest.approx(1.0)
    groupnorm = next(m for m in moves if m.kernel == "groupnorm")
    assert groupnorm.share < 0  # moved against the net change
    assert len(attribute(b, c, top=2)) == 2


# ---- fidelity -----------------------------------------------------------------------------


def test_psnr_matches_numpy_reference_and_identical_is_inf(tmp_path):
    rng = np.random.default_rng(60)
    a = rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)
    b = np.clip(a.astype(int) + rng.integers(-3, 4, a.shape), 0, 255).astype(np.uint8)
    mse = np.mean((a.astype(np.float64) - b) ** 2)
    assert psnr(a, b) == pytest.approx(10 * np.log10(255**2 / mse), rel=1e-12)
    assert psnr(a, a.copy()) == math.inf
    assert compare_images(a, b) == (psnr(a, b), False)  # about 38 dB: within tolerance
    noisy = rng.integers(0, 256, a.shape, dtype=np.uint8)
    check = compare_images(a, noisy)
    assert check.changed and check.psnr_db < 30
    Image.fromarray(a).save(tmp_path / "a.png")
    Image.fromarray(b).save(tmp_path / "b.png")
    assert psnr(tmp_path / "a.png", str(tmp_path / "b.png")) == pytest.approx(psnr(a, b))
    with pytest.raises(ValueError, match="differ in size"):
        psnr(a, a[:16])


# ---- thermal ------------------------------------------------------------------------------


def test_thermal_flags():
    cool = [("before", "gpu", 36.0), ("after", "gpu", 62.0), ("after", "battery", 38.0)]
    ok = thermal_flag(cooldown_timed_out=False, readings=cool)
    assert not ok.flagged and ok.reasons == () and ok.hottest_after == 62.0
    timed_out = thermal_flag(cooldown_timed_out=True, readings=cool)
    assert timed_out.flagged and timed_out.reasons == ("cool-down timed out",)
    hot = thermal_flag(cooldown_timed_out=False, readings=[ThermalReading("after", "gpu", 91.0)])
    assert hot.flagged and "gpu at 91.0 C after" in hot.reasons[0]
    warm_start = thermal_flag(cooldown_timed_out=False, readings=cool, max_start_celsius=35.0)
    assert warm_start.flagged and "cool-down target" in warm_start.reasons[0]
    with pytest.raises(ValueError, match="phase"):
        thermal_flag(cooldown_timed_out=False, readings=[("during", "gpu", 50.0)])


def test_rounds_are_asked_for_only_where_they_can_decide():
    """With 10% run-to-run drift and a 15% minimum effect, one run of A against one of A'
    (ratio about 1) is inconclusive, and two more runs of each could not make it "same" (the
    interval stays wider than 15%) nor a change: no round is asked for, and the reason says
    so. A 1.4x ratio with the same noise can become a regression: rounds are asked for."""
    rng = np.random.default_rng(20261127)
    base = 100 * rng.lognormal(0.0, 0.02, 10)
    runs = [0] * 10
    flat = rg.compare(base, 100 * rng.lognormal(0.0, 0.02, 10), baseline_runs=runs, candidate_runs=runs,
                      drift=0.10, min_effect=0.15, runs_left=2)
    assert flat.verdict == "inconclusive" and flat.more_repetitions_suggested == 0
    assert "2 more runs of each build could not decide it either" in flat.reason
    unlimited = rg.compare(base, 100 * rng.lognormal(0.0, 0.02, 10), baseline_runs=runs, candidate_runs=runs,
                           drift=0.10, min_effect=0.15)
    assert unlimited.verdict == "inconclusive" and unlimited.more_repetitions_suggested > 0  # no budget given
    slower = rg.compare(base, 140 * rng.lognormal(0.0, 0.02, 10), baseline_runs=runs, candidate_runs=runs,
                        drift=0.10, min_effect=0.15, runs_left=2)
    assert slower.verdict == "inconclusive" and slower.cause == "drift" and slower.more_repetitions_suggested > 0
    none_left = rg.compare(base, 140 * rng.lognormal(0.0, 0.02, 10), baseline_runs=runs, candidate_runs=runs,
                           drift=0.10, min_effect=0.15, runs_left=0)
    assert none_left.more_repetitions_suggested == 0


def test_a_faster_candidate_within_the_band_gets_the_rounds_that_can_make_it_same():
    """b1 against itself in `farm check` (a clean clone's CI run): the baseline's four runs
    came out 12% slower than the candidate's, the interval [0.744, 1.045] just left the 25%
    band, and the check stopped with exit 2 because "4 more runs could not decide it": the
    test for that held a ratio below 1 to the band above 1 (its mirror image, 1.136, against
    1.25). Four more runs of each can place the interval inside [0.75, 1.25]."""
    # unet_step_ms of the check's eight latency jobs (6 repetitions each), A B B A A B B A
    jobs = [[171.7, 204.9, 194.4, 189.5, 217.3, 229.3], [159.7, 153.7, 138.9, 132.0, 142.4, 144.2],
            [157.9, 174.7, 166.0, 173.3, 200.2, 194.8], [183.8, 185.3, 183.3, 175.4, 203.5, 171.6],
            [174.9, 187.5, 231.8, 174.3, 197.3, 224.3], [223.9, 194.6, 175.3, 208.0, 183.7, 181.6],
            [184.1, 153.0, 158.7, 144.5, 152.4, 166.2], [138.8, 198.7, 162.3, 180.9, 196.7, 209.0]]
    roles = "ABBAABBA"
    base = [v for j, r in zip(jobs, roles, strict=True) if r == "A" for v in j]
    cand = [v for j, r in zip(jobs, roles, strict=True) if r == "B" for v in j]
    base_runs = [i for i, r in enumerate(roles) if r == "A" for _ in range(6)]
    cand_runs = [i for i, r in enumerate(roles) if r == "B" for _ in range(6)]
    faster = rg.compare(base, cand, baseline_runs=base_runs, candidate_runs=cand_runs, drift=0.10,
                        min_effect=0.25, runs_left=4)
    assert faster.verdict == "inconclusive" and faster.ratio == pytest.approx(0.881, abs=0.005)
    assert faster.more_repetitions_suggested > 0, faster.reason
    # the same numbers the other way round (a 1.136x slower candidate) cannot become "same"
    # within a 1.25 ceiling, nor a regression beyond it, in four more runs
    slower = rg.compare(cand, base, baseline_runs=cand_runs, candidate_runs=base_runs, drift=0.10,
                        min_effect=0.25, runs_left=4)
    assert slower.verdict == "inconclusive" and slower.more_repetitions_suggested == 0, slower.reason
