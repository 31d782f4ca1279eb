"""Trend charts drawn as inline SVG on the server, so a page needs no script and opens from
file://: builds along x (oldest first, evenly spaced, since builds are versions, not times),
the metric along y, the per-build median as a line through points, its interquartile range as a
dark band and its extremes as a light one, and each alert on the series as a marker above its
build that links to the alert's page. Hovering a point or marker shows its numbers (SVG
<title>)."""

from __future__ import annotations

from html import escape

from .data import Trend

W, H = 640, 240  # viewBox size
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 22, 64  # plot margins: axis labels left, rotated build names below

KIND_COLOR = {"regression": "#d62728", "improvement": "#2ca02c", "fidelity": "#9467bd", "data_stoppage": "#7f7f7f"}


def fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}g}" if abs(value) < 1e6 else f"{value:.4e}"


def tick(value: float) -> str:
    """An axis label short enough for the margin: SI prefixes from ten thousand up."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e4, "k")):
        if abs(value) >= scale:
            return f"{value / (scale if prefix != 'k' else 1e3):.4g}{prefix}"
    return f"{value:.4g}"


def _band(xs: list[float], upper: list[float], lower: list[float]) -> str:
    """A closed path along `upper` left to right and back along `lower`; one build gets a short
    box so its band is still visible."""
    if len(xs) == 1:
        xs, upper, lower = [xs[0] - 6, xs[0] + 6], upper * 2, lower * 2
    forward = " ".join(f"L{x:.1f},{y:.1f}" for x, y in zip(xs, upper, strict=True))
    back = " ".join(f"L{x:.1f},{y:.1f}" for x, y in zip(reversed(xs), reversed(lower), strict=True))
    return "M" + (forward + " " + back)[1:] + " Z"


def trend_svg(trend: Trend, device: str, alert_href: str = "alerts/alert-{id}.html") -> str:
    """One metric on one device over builds, as an <svg> element."""
    p = trend.points
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM
    y_min, y_max = min(pt.lo for pt in p), max(pt.hi for pt in p)
    pad = (y_max - y_min) * 0.08 or abs(y_max) * 0.05 or 1.0
    y_min, y_max = y_min - pad, y_max + pad

    def x_of(i: int) -> float:
        return LEFT + (plot_w * (i + 0.5) / len(p))

    def y_of(v: float) -> float:
        return TOP + plot_h * (1 - (v - y_min) / (y_max - y_min))

    xs = [x_of(i) for i in range(len(p))]
    label = f"{trend.metric} ({trend.unit}) on {device} over {len(p)} builds"
    out = [f'<svg class="trend" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
           f'data-device="{escape(device)}" data-metric="{escape(trend.metric)}" aria-label="{escape(label)}">',
           f"<title>{escape(label)}</title>"]
    # y axis: five gridlines with values
    for k in range(5):
        v = y_min + (y_max - y_min) * k / 4
        y = y_of(v)
        out.append(f'<line class="grid" x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
                   f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{tick(v)}</text>')
    out.append(f'<text class="axis-label" x="12" y="{TOP + plot_h / 2:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 12 {TOP + plot_h / 2:.1f})">{escape(trend.metric)} ({escape(trend.unit)})</text>')
    # bands, then the median line and its points
    out.append(f'<path class="band-range" d="{_band(xs, [y_of(pt.hi) for pt in p], [y_of(pt.lo) for pt in p])}"/>')
    out.append(f'<path class="band-iqr" d="{_band(xs, [y_of(pt.q3) for pt in p], [y_of(pt.q1) for pt in p])}"/>')
    line = " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y_of(pt.median):.1f}" for i, (x, pt) in enumerate(zip(xs, p,
                                                                                                       strict=True)))
    out.append(f'<path class="median" d="{line}"/>')
    for x, pt in zip(xs, p, strict=True):
        tip = (f"{pt.build}: median {fmt(pt.median)} {trend.unit}, IQR {fmt(pt.q1)}–{fmt(pt.q3)}, "
               f"range {fmt(pt.lo)}–{fmt(pt.hi)}, n={pt.n}")
        out.append(f'<circle class="point" cx="{x:.1f}" cy="{y_of(pt.median):.1f}" r="3.5">'
                   f"<title>{escape(tip)}</title></circle>")
        out.append(f'<text class="build" x="{x:.1f}" y="{H - BOTTOM + 12}" text-anchor="end" '
                   f'transform="rotate(-35 {x:.1f} {H - BOTTOM + 12})">{escape(pt.build)}</text>')
    # alert markers: a triangle above the build, stacked when a build has several
    index = {pt.build: i for i, pt in enumerate(p)}
    stacked: dict[str, int] = {}
    for marker in trend.alerts:
        x = xs[index[marker.build]]
        level = stacked[marker.build] = stacked.get(marker.build, -1) + 1
        x, y = x + 9 * level, TOP - 4
        color = KIND_COLOR.get(marker.kind, "#000")
        tip = f"alert #{marker.alert_id} {marker.kind} ({marker.state}): {marker.summary}"
        out.append(f'<a class="alert-link" href="{escape(alert_href.format(id=marker.alert_id))}">'
                   f'<line class="alert-rule" x1="{x:.1f}" x2="{x:.1f}" y1="{y:.1f}" y2="{TOP + plot_h}" '
                   f'stroke="{color}"/>'
                   f'<path class="alert-marker alert-{escape(marker.kind)}" fill="{color}" '
                   f'd="M{x - 6:.1f},{y - 9:.1f} L{x + 6:.1f},{y - 9:.1f} L{x:.1f},{y + 1:.1f} Z">'
                   f"<title>{escape(tip)}</title></path></a>")
    out.append("</svg>")
    return "".join(out)


def share_bar(share: float | None, width: int = 160) -> str:
    """A horizontal bar for a kernel's share of a change (0..1; negative shares draw nothing)."""
    w = max(0.0, min(1.0, share or 0.0)) * width
    return (f'<svg class="share" viewBox="0 0 {width} 12" width="{width}" height="12" aria-hidden="true">'
            f'<rect class="share-track" width="{width}" height="12"/><rect class="share-fill" width="{w:.1f}" '
            f'height="12"/></svg>')
