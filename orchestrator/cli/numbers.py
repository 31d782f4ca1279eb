"""How the CLI writes numbers for people: bytes in KiB, MiB or GiB, milliseconds with as many
digits as they carry, ratios as 1.052, changes as +5.2% (never -0%), p-values as 0.003 or
<0.001. A metric's unit is in its name (unet_step_ms, peak_gpu_bytes), so `metric_value`
picks the format from it. None is "-" everywhere: a value not measured."""

from __future__ import annotations

import math

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
MISSING = "-"


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def decimals(value: float) -> int:
    """Digits after the point that keep about three significant ones (none from 1000 on)."""
    size = abs(value)
    return 0 if size >= 1000 else 1 if size >= 100 else 2 if size >= 10 else 3


def plain(value: float | None) -> str:
    """A number with about three significant digits and thousands separated: 1,234 / 12.35."""
    if not _finite(value):
        return MISSING if value is None else str(value)
    text = f"{value:,.{decimals(value)}f}"
    return "0" if float(text.replace(",", "")) == 0 else text


def byte_size(value: float | None) -> str:
    """8.92 MiB, 1.50 GiB, 512 B."""
    if not _finite(value):
        return MISSING if value is None else str(value)
    size = abs(value)
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if size >= scale:
            return f"{value / scale:,.2f} {unit}"
    return f"{value:,.0f} B"


def ms(value: float | None) -> str:
    """12.35 ms, 1,234 ms."""
    return MISSING if value is None else f"{plain(value)} ms"


def metric_value(metric: str, value: float | None, unit: str | None = None) -> str:
    """`value` of `metric` in its unit (from `unit`, else the metric's name)."""
    unit = unit or metric.rsplit("_", 1)[-1]
    if unit == "bytes":
        return byte_size(value)
    if unit == "ms":
        return ms(value)
    return plain(value)


def ratio(value: float | None) -> str:
    """A ratio of two medians: 1.052."""
    return f"{value:.3f}" if _finite(value) else MISSING if value is None else str(value)


def change(ratio_value: float | None) -> str:
    """The change a ratio means, in percent with one decimal: +5.2%, -3.0%, 0.0% (never -0.0%)."""
    if not _finite(ratio_value):
        return MISSING
    percent = round(100 * (ratio_value - 1), 1)
    return "0.0%" if percent == 0 else f"{percent:+.1f}%"


def interval(low: float | None, high: float | None) -> str:
    """A ratio's interval: 0.981-1.034."""
    return MISSING if low is None or high is None else f"{ratio(low)}-{ratio(high)}"


def p_value(value: float | None) -> str:
    """0.042, 0.003, <0.001."""
    if not _finite(value):
        return MISSING
    return "<0.001" if value < 0.001 else f"{value:.3f}"
