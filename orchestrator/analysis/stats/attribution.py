"""Which kernels made a build slower (or faster): per-kernel medians of the total ms per
repetition, for the baseline and the candidate, and each kernel's share of the net change."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KernelMove:
    kernel: str
    baseline_ms: float  # median over repetitions of the kernel's total ms (0 when absent)
    candidate_ms: float
    delta_ms: float  # candidate_ms - baseline_ms
    share: float  # delta_ms / the sum of deltas moving in the net direction (see attribute)


def _median(name: str, values: Sequence[float]) -> float:
    x = np.asarray(values, dtype=float).ravel()
    if x.size == 0:
        return 0.0
    if not np.all(np.isfinite(x)):
        raise ValueError(f"kernel {name!r} has non-finite timings {x[~np.isfinite(x)][:5].tolist()}")
    return float(np.median(x))


def attribute(
    baseline: Mapping[str, Sequence[float]],
    candidate: Mapping[str, Sequence[float]],
    *,
    top: int | None = 10,
) -> list[KernelMove]:
    """The kernels whose timings moved most, largest |delta_ms| first (ties by name).

    `baseline` and `candidate` map a kernel name to its total ms in each repetition
    (KernelTiming.total_ms grouped by kernel); a kernel missing from one side counts 0 ms
    there (a kernel a new profile replaced). Normalisation: the net change is the sum of all
    deltas; kernels that moved in its direction are the movers and their shares sum to 1;
    kernels that moved against it get a negative share on the same scale (they offset part of
    the change). `top` keeps the first kernels after the shares are computed."""
    kernels = sorted(set(baseline) | set(candidate))
    moves = []
    for k in kernels:
        b, c = _median(k, baseline.get(k, ())), _median(k, candidate.get(k, ()))
        moves.append((k, b, c, c - b))
    net = sum(d for *_, d in moves)
    sign = 1.0 if net >= 0 else -1.0
    with_net = sum(d for *_, d in moves if d * sign > 0)
    result = [
        KernelMove(k, b, c, d, d / with_net if with_net else 0.0)
        for k, b, c, d in moves
    ]
    result.sort(key=lambda mv: (-abs(mv.delta_ms), mv.kernel))
    return result if top is None else result[:top]
