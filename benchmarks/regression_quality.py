"""How often the regression analysis cries wolf and how often it misses: simulated nightly
series with realistic noise, run through orchestrator.analysis.stats.compare (A/A: no change; A/B:
the candidate slower by 2%, 5%, 10%) including the "inconclusive -> more repetitions" loop, and
through detect_change_points on simulated build histories (a real step, single spikes, flat).

    python benchmarks/regression_quality.py                       # table on stdout
    python benchmarks/regression_quality.py --json out.json --series 2000
    python benchmarks/regression_quality.py --only-small --json out.json   # 5-10 samples a build

The noise model (per series): a base latency drawn from 20-500 ms; each run (one night's
repetitions on one device) multiplies it by a run-to-run drift exp(N(0, drift)); each
repetition by exp(N(0, sigma)); each repetition is, with a probability drawn from 2-5% per
series, an outlier 1.5-3x slower (a background task, a throttled frame). Extra repetitions
asked for by an inconclusive verdict come from a new run of each build (a new drift draw).
Targets: at most 5% of A/A series flagged per night; at least 90% of 5% shifts detected.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.analysis.stats import compare, detect_change_points  # noqa: E402
from orchestrator.analysis.stats.compare import DEFAULT_DRIFT, MAX_REPETITIONS, estimate_drift  # noqa: E402

REPETITIONS = 10  # per build per night: the default sample count
HISTORY_RUNS = 14  # nights of history before the comparison, from which the drift is estimated
SHIFTS = [0.0, 0.02, 0.05, 0.10]
VERDICTS = ["regression", "improvement", "same", "inconclusive"]


@dataclass(frozen=True)
class Noise:
    name: str
    sigma: float  # within-run lognormal sigma (about the coefficient of variation)
    drift: float  # run-to-run lognormal sigma
    outlier_p: tuple[float, float] = (0.02, 0.05)
    outlier_x: tuple[float, float] = (1.5, 3.0)


NOISES = {
    "quiet": Noise("quiet", 0.01, 0.005),
    "typical": Noise("typical", 0.02, 0.01),
    "noisy": Noise("noisy", 0.03, 0.015),
}


def draw_run(rng: np.random.Generator, base: float, n: int, noise: Noise, p_out: float) -> np.ndarray:
    x = base * np.exp(rng.normal(0.0, noise.drift)) * np.exp(rng.normal(0.0, noise.sigma, n))  # (n,)
    out = rng.random(n) < p_out
    x[out] *= rng.uniform(*noise.outlier_x, out.sum())
    return x


def simulate_compare(shift: float, noise: Noise, n_series: int, seed: int, max_repetitions: int,
                     history_runs: int) -> dict:
    """Per series: `history_runs` earlier nights at the baseline's level (the drift is
    estimated from them, DEFAULT_DRIFT when there are too few), then one run of each build,
    then the loop: each more-repetitions round is a new run of both builds, as the nightly
    analysis schedules it."""
    rng = np.random.default_rng(seed)
    first = dict.fromkeys(VERDICTS, 0)
    final = dict.fromkeys(VERDICTS, 0)
    reps, rounds, drifts = [], [], []
    for _ in range(n_series):
        base, p_out = rng.uniform(20, 500), rng.uniform(*noise.outlier_p)
        history = [draw_run(rng, base, REPETITIONS, noise, p_out) for _ in range(history_runs)]
        estimated = estimate_drift(history)
        drift = DEFAULT_DRIFT if estimated is None else estimated
        drifts.append(drift)
        b = draw_run(rng, base, REPETITIONS, noise, p_out)
        c = draw_run(rng, base * (1 + shift), REPETITIONS, noise, p_out)
        b_runs, c_runs = [0] * b.size, [0] * c.size
        res = compare(b, c, baseline_runs=b_runs, candidate_runs=c_runs, drift=drift,
                      max_repetitions=max_repetitions)
        first[res.verdict] += 1
        k = 1
        while res.verdict == "inconclusive" and res.more_repetitions_suggested > 0:
            extra = res.more_repetitions_suggested
            b = np.concatenate([b, draw_run(rng, base, extra, noise, p_out)])
            c = np.concatenate([c, draw_run(rng, base * (1 + shift), extra, noise, p_out)])
            b_runs, c_runs = b_runs + [k] * extra, c_runs + [k] * extra
            res = compare(b, c, baseline_runs=b_runs, candidate_runs=c_runs, drift=drift,
                          max_repetitions=max_repetitions)
            k += 1
        final[res.verdict] += 1
        reps.append(b.size)
        rounds.append(k)
    frac = lambda d: {v: d[v] / n_series for v in VERDICTS}  # noqa: E731
    return {
        "shift": shift, "noise": noise.name, "series": n_series, "max_repetitions": max_repetitions,
        "first_look": frac(first), "after_loop": frac(final),
        "mean_repetitions_per_build": float(np.mean(reps)),
        "p90_repetitions_per_build": float(np.percentile(reps, 90)),
        "mean_rounds": float(np.mean(rounds)), "history_runs": history_runs,
        "drift_estimate_median": float(np.median(drifts)),
        "drift_estimate_p10_p90": [float(np.percentile(drifts, 10)), float(np.percentile(drifts, 90))],
    }


SMALL_SAMPLES = (5, 6, 7, 8, 10)
SMALL_SHIFTS = (0.0, 1.0)  # A/A, and the candidate twice as slow


def previous_p(res, b: np.ndarray, c: np.ndarray) -> float:
    """The p of the method before issue 26: the smaller of Mann-Whitney and Kolmogorov-Smirnov,
    doubled (Bonferroni), against the same drift-aware test."""
    import warnings

    from scipy import stats

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="ks_2samp: Exact calculation unsuccessful")
        p_ks = float(stats.ks_2samp(b, c, alternative="two-sided").pvalue)
    return max(min(1.0, 2.0 * min(res.p_mannwhitney, p_ks)), res.p_drift)


def simulate_small(n: int, shift: float, noise: Noise, n_series: int, seed: int, history_runs: int,
                   min_effect: float, extra_rounds: int = 2) -> dict:
    """One run of n repetitions of each build (a first look, as a CI check or the demo has), the
    candidate `shift` slower: how often each verdict comes out, with this method and with the
    previous one (same data, same interval); then after up to `extra_rounds` more-repetitions
    rounds (each a new run of both builds of the size the comparison asks for), as the demo
    runs them."""
    rng = np.random.default_rng(seed)
    now, before, final = (dict.fromkeys(VERDICTS, 0) for _ in range(3))
    for _ in range(n_series):
        base, p_out = rng.uniform(20, 500), rng.uniform(*noise.outlier_p)
        history = [draw_run(rng, base, REPETITIONS, noise, p_out) for _ in range(history_runs)]
        estimated = estimate_drift(history)
        drift = DEFAULT_DRIFT if estimated is None else estimated
        b = draw_run(rng, base, n, noise, p_out)
        c = draw_run(rng, base * (1 + shift), n, noise, p_out)
        res = compare(b, c, drift=drift, min_effect=min_effect)
        now[res.verdict] += 1
        verdict = res.verdict
        if res.verdict in ("regression", "improvement", "inconclusive"):
            p_old, m, r = previous_p(res, b, c), min_effect, res.ratio
            changed = p_old <= 0.01 and (r > 1 + m or r < 1 - m)
            verdict = ("regression" if r > 1 else "improvement") if changed else "inconclusive"
        before[verdict] += 1
        b_runs, c_runs = [0] * n, [0] * n
        for k in range(1, extra_rounds + 1):
            if res.verdict != "inconclusive" or res.more_repetitions_suggested == 0:
                break
            extra = res.more_repetitions_suggested
            b = np.concatenate([b, draw_run(rng, base, extra, noise, p_out)])
            c = np.concatenate([c, draw_run(rng, base * (1 + shift), extra, noise, p_out)])
            b_runs, c_runs = b_runs + [k] * extra, c_runs + [k] * extra
            res = compare(b, c, baseline_runs=b_runs, candidate_runs=c_runs, drift=drift, min_effect=min_effect)
        final[res.verdict] += 1
    frac = lambda d: {v: d[v] / n_series for v in VERDICTS}  # noqa: E731
    return {"n": n, "shift": shift, "noise": noise.name, "outliers": noise.outlier_p, "series": n_series,
            "history_runs": history_runs, "min_effect": min_effect, "extra_rounds": extra_rounds,
            "verdicts": frac(now), "previous_method": frac(before), "after_rounds": frac(final)}


def simulate_history(kind: str, noise: Noise, n_hist: int, length: int, seed: int) -> dict:
    """Histories of per-build medians (REPETITIONS samples each, one run per build)."""
    rng = np.random.default_rng(seed)
    detected = false_alarm = 0
    located = []
    for _ in range(n_hist):
        base, p_out = rng.uniform(20, 500), rng.uniform(*noise.outlier_p)
        step_at = int(rng.integers(3, length - 3 + 1))
        spike_at = int(rng.integers(0, length))
        history = []
        for i in range(length):
            level = base
            if kind.startswith("step") and i >= step_at:
                level *= 1 + {"step5": 0.05, "step10": 0.10, "step5+spike": 0.05}[kind]
            samples = draw_run(rng, level, REPETITIONS, noise, p_out)
            if kind in ("spike", "step5+spike") and i == spike_at:
                samples *= rng.uniform(1.3, 2.0)  # a throttled night: every repetition slower
            history.append(samples)
        cps = detect_change_points(history, seed=0)
        idx = [cp.index for cp in cps]
        if kind.startswith("step"):
            near = [i for i in idx if abs(i - step_at) <= 1]
            detected += bool(near)
            false_alarm += any(abs(i - step_at) > 1 for i in idx)
            if near:
                located.append(abs(near[0] - step_at))
        else:
            false_alarm += bool(idx)
    return {
        "kind": kind, "noise": noise.name, "histories": n_hist, "length": length,
        "detection_rate": detected / n_hist if kind.startswith("step") else None,
        "exact_index_rate": (located.count(0) / n_hist) if kind.startswith("step") else None,
        "false_alarm_rate": false_alarm / n_hist,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--series", type=int, default=2000, help="series per scenario (typical noise)")
    ap.add_argument("--sensitivity-series", type=int, default=500, help="series per scenario, other noise levels")
    ap.add_argument("--histories", type=int, default=500, help="histories per change-point scenario")
    ap.add_argument("--length", type=int, default=30, help="builds per history")
    ap.add_argument("--history-runs", type=int, default=HISTORY_RUNS,
                    help="nights of history per series for the drift estimate (0: the default drift)")
    ap.add_argument("--only-compare", action="store_true", help="skip the change-point histories")
    ap.add_argument("--only-small", action="store_true", help="only the 5-10 sample first looks")
    ap.add_argument("--small-series", type=int, default=2000, help="series per small-sample scenario")
    ap.add_argument("--seed", type=int, default=20261121)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    t0 = time.perf_counter()

    # 1. Comparisons: the default noise at full size, the bound on repetitions varied, then
    #    the other noise levels.
    #    Then the typical noise without history (the default drift: a new series).
    # 0. Small samples: one run of 5-10 repetitions a build, A/A and a 2x slowdown, this method
    #    against the previous one; new series (default drift) and series with history, the
    #    default minimum effect and the demo's 15%.
    small = []
    clean = Noise("typical, no outliers", 0.02, 0.01, outlier_p=(0.0, 0.0))
    for j, (noise, hist, m) in enumerate([(clean, 0, 0.03), (NOISES["typical"], 0, 0.03),
                                          (NOISES["typical"], args.history_runs, 0.03), (NOISES["noisy"], 0, 0.15)]):
        for n in SMALL_SAMPLES:
            for i, shift in enumerate(SMALL_SHIFTS):
                small.append(simulate_small(n, shift, noise, args.small_series, args.seed + 5000 + 100 * j + 10 * n + i,
                                            hist, m))
    print("compare() on one run of n repetitions a build (alpha 0.01): regression / improvement / same / "
          "inconclusive, %; then after up to 2 more-repetitions rounds")
    print(f"{'noise':21} {'history':>7} {'min eff':>7} {'n':>3} {'shift':>6} | {'first look, previous':>27} | "
          f"{'first look, now':>27} | {'after rounds, now':>27}")
    for r in small:
        fmt = lambda d: " ".join(f"{100 * d[v]:6.1f}" for v in VERDICTS)  # noqa: E731
        print(f"{r['noise']:21} {r['history_runs']:7d} {100 * r['min_effect']:6.0f}% {r['n']:3d} "
              f"{100 * r['shift']:5.0f}% | {fmt(r['previous_method'])} | {fmt(r['verdicts'])} | "
              f"{fmt(r['after_rounds'])}")
    print()
    if args.only_small:
        args.only_compare = True
    runs = [] if args.only_small else [(NOISES["typical"], args.series, MAX_REPETITIONS, args.history_runs)]
    if not args.only_small:
        runs += [(NOISES[n], args.sensitivity_series, MAX_REPETITIONS, args.history_runs) for n in ("quiet", "noisy")]
        runs += [(NOISES["typical"], args.sensitivity_series, MAX_REPETITIONS, 0)]
    comparisons = []
    for j, (noise, n, max_reps, hist) in enumerate(runs):
        for i, shift in enumerate(SHIFTS):
            comparisons.append(simulate_compare(shift, noise, n, args.seed + 100 * j + i, max_reps, hist))
    print(f"compare(): {REPETITIONS} repetitions per build per run, min_effect 3%, alpha 0.01, 95% interval")
    print(f"{'noise':8} {'history':>7} {'shift':>6} {'series':>6} | {'first look: reg/imp/same/inc':>30} | "
          f"{'after loop: reg/imp/same/inc':>30} | {'mean reps':>9} | {'drift est':>9}")
    for r in comparisons:
        f, a = r["first_look"], r["after_loop"]
        fmt = lambda d: " ".join(f"{100 * d[v]:6.1f}" for v in VERDICTS)  # noqa: E731
        print(f"{r['noise']:8} {r['history_runs']:7d} {100 * r['shift']:5.0f}% {r['series']:6d} | {fmt(f)} | "
              f"{fmt(a)} | {r['mean_repetitions_per_build']:9.1f} | {100 * r['drift_estimate_median']:8.2f}%")

    # 2. Change points on build histories.
    histories = []
    for j, kind in enumerate([] if args.only_compare else ["flat", "spike", "step5", "step10", "step5+spike"]):
        histories.append(simulate_history(kind, NOISES["typical"], args.histories, args.length, args.seed + 1000 + j))
    print(f"\ndetect_change_points(): {args.length} builds, min_segment 3, 199 permutations, p <= 0.01")
    print(f"{'history':12} {'n':>5} {'detected':>9} {'exact idx':>9} {'false alarm':>11}")
    for h in histories:
        pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        print(f"{h['kind']:12} {h['histories']:5d} {pct(h['detection_rate']):>9} {pct(h['exact_index_rate']):>9} "
              f"{pct(h['false_alarm_rate']):>11}")
    elapsed = time.perf_counter() - t0
    print(f"\n{elapsed:.0f} s")

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "benchmark": "regression_quality",
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "platform": platform.platform(), "python": platform.python_version(),
            "seed": args.seed, "repetitions": REPETITIONS, "noise_models": {k: asdict(v) for k, v in NOISES.items()},
            "small_samples": small, "compare": comparisons, "change_points": histories, "elapsed_s": round(elapsed, 1),
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
