"""Writes the static site: index.html (devices with state and temperatures, the alerts list,
per-device trend charts) and alerts/alert-<id>.html (one alert: its compare table, kernel
attribution and the images before and after, copied into images/ so the folder is whole on
its own). Every page carries its own stylesheet and no script; links are relative, so the
folder works from file:// or behind any static server."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from collections.abc import Callable
from html import escape
from pathlib import Path

from sqlalchemy.orm import Session

from .charts import KIND_COLOR, fmt, share_bar, trend_svg
from .data import AlertView, DeviceView, SiteData, read_site_data

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0 auto;max-width:1100px;padding:0 16px 48px;color:#222}
h1{font-size:22px;margin:18px 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:16px 0 4px}nav a{margin-right:14px}.muted{color:#777}
table{border-collapse:collapse;margin:6px 0}th,td{padding:3px 10px;border-bottom:1px solid #eee;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.state{padding:1px 7px;border-radius:8px;color:#fff;font-size:12px}
.state-available,.state-fixed{background:#2ca02c}.state-busy,.state-acknowledged{background:#d6a100}
.state-offline,.state-unauthorized,.state-new{background:#d62728}.state-quarantined{background:#9467bd}
.state-invalid{background:#7f7f7f}
.kind{font-weight:600}.charts{display:flex;flex-wrap:wrap;gap:8px}
svg.trend{background:#fafafa;border:1px solid #e4e4e4;width:calc(50% - 6px);min-width:420px;height:auto}
svg .grid{stroke:#e6e6e6}svg .tick,svg .build,svg .axis-label{font-size:10px;fill:#555}
svg .band-range{fill:#1f77b4;fill-opacity:.12}svg .band-iqr{fill:#1f77b4;fill-opacity:.3}
svg .median{fill:none;stroke:#1f77b4;stroke-width:2}svg .point{fill:#1f77b4}
svg .alert-rule{stroke-dasharray:3 3;stroke-width:1}svg .share-track{fill:#eee}svg .share-fill{fill:#d62728}
.images{display:flex;gap:16px}.images figure{margin:0}.images img{max-width:420px;border:1px solid #ddd}
pre{background:#f6f6f6;padding:8px;overflow:auto}
"""


def _page(title: str, body: str, root: str = "") -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
            f'<nav><a href="{root}index.html#devices">Devices</a><a href="{root}index.html#alerts">Alerts</a>'
            f'<a href="{root}index.html#trends">Trends</a></nav>{body}</body></html>\n')


def _when(value: dt.datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M UTC") if value is not None else "—"


def _state(state: str) -> str:
    return f'<span class="state state-{escape(state)}">{escape(state)}</span>'


def _kind(kind: str) -> str:
    return f'<span class="kind" style="color:{KIND_COLOR.get(kind, "#000")}">{escape(kind)}</span>'


def _ci(low: float | None, high: float | None) -> str:
    return "—" if low is None or high is None else f"[{fmt(low)}, {fmt(high)}]"


def _celsius(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} °C"


def _alert_href(alert_id: int) -> str:
    return f"alerts/alert-{alert_id}.html"


# ---- index ---------------------------------------------------------------------------------


def _devices_table(devices: list[DeviceView]) -> str:
    rows = "".join(
        f'<tr><td><a href="#device-{d.id}">{escape(d.serial)}</a></td><td>{escape(d.model)}</td>'
        f"<td>{_state(d.state)} <span class=\"muted\">{escape(d.state_reason)}</span></td>"
        f"<td>{_when(d.last_seen)}</td><td class=\"num\">{d.runs}</td><td class=\"num\">{d.cooldown_timed_out}</td>"
        f"<td class=\"num\">{fmt(d.last_cooldown_wait_s)}</td><td class=\"num\">{_celsius(d.hottest('before'))}</td>"
        f"<td class=\"num\">{_celsius(d.hottest('after'))}</td></tr>"
        for d in devices)
    return ('<table id="device-table"><tr><th>device</th><th>model</th><th>state</th><th>last seen</th>'
            "<th>runs</th><th>cool-down timed out</th><th>last cool-down wait (s)</th>"
            "<th>hottest before run</th><th>hottest after run</th></tr>" + rows + "</table>"
            if devices else '<p class="muted">No devices yet.</p>')


def _alerts_table(alerts: list[AlertView]) -> str:
    if not alerts:
        return '<p class="muted">No alerts.</p>'
    rows = "".join(
        f'<tr><td><a class="alert-item" href="{_alert_href(a.id)}">#{a.id}</a></td><td>{_state(a.state)}</td>'
        f"<td>{_kind(a.kind)}</td><td>{escape(a.device or '—')}</td><td>{escape(a.build or '—')}</td>"
        f"<td>{escape(a.metric or '—')}</td><td class=\"num\">{fmt(a.ratio)}</td>"
        f"<td class=\"num\">{_ci(a.ci_low, a.ci_high)}</td><td>{escape(a.summary)}</td>"
        f"<td>{_when(a.created_at)}</td></tr>"
        for a in alerts)
    return ('<table id="alert-table"><tr><th>alert</th><th>state</th><th>kind</th><th>device</th><th>build</th>'
            "<th>metric</th><th>ratio</th><th>95% CI</th><th>summary</th><th>created</th></tr>" + rows + "</table>")


def _trends(devices: list[DeviceView]) -> str:
    parts = []
    for d in devices:
        charts = "".join(trend_svg(t, d.serial) for t in d.trends if t.points)
        parts.append(f'<section class="device-trends" id="device-{d.id}"><h3>{escape(d.serial)} '
                     f'<span class="muted">{escape(d.model)}</span></h3>'
                     + (f'<div class="charts">{charts}</div>' if charts else
                        '<p class="muted">No measurements over builds yet.</p>') + "</section>")
    return "".join(parts)


def render_index(data: SiteData) -> str:
    body = (f"<h1>devicefarm</h1><p class=\"muted\">Built {_when(data.generated_at)} from the store.</p>"
            f'<h2 id="devices">Devices</h2>{_devices_table(data.devices)}'
            f'<h2 id="alerts">Alerts</h2>{_alerts_table(data.alerts)}'
            f'<h2 id="trends">Trends over builds</h2><p class="muted">Line: per-build median; dark band: '
            "interquartile range; light band: lowest to highest sample. Triangles are alerts (click for "
            f"detail).</p>{_trends(data.devices)}")
    return _page("devicefarm dashboard", body)


# ---- alert pages ---------------------------------------------------------------------------


def _copy_image(path: str, image_root: Path | None, out_dir: Path, name: str) -> str | None:
    """Copy one image into out_dir/images and return its href from an alert page, or None when
    the file is gone (the page says so instead of showing a broken image)."""
    source = Path(path)
    if not source.is_absolute() and image_root is not None:
        source = image_root / source
    if not source.is_file():
        return None
    target = out_dir / "images" / f"{name}{source.suffix.lower()}"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return f"../images/{target.name}"


def render_alert(alert: AlertView, images: dict[str, str | None]) -> str:
    meta = [("kind", _kind(alert.kind)), ("state", _state(alert.state)), ("device", escape(alert.device or "—")),
            ("build", escape(alert.build or "—")), ("baseline build", escape(alert.baseline or "—")),
            ("created", _when(alert.created_at)), ("note", escape(alert.note or "—"))]
    meta_html = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in meta)
    compare = "".join(
        f"<tr><td>{escape(r.metric)}</td><td class=\"num\">{fmt(r.baseline)}</td><td class=\"num\">{fmt(r.new)}</td>"
        f"<td class=\"num\">{fmt(r.ratio)}</td><td class=\"num\">{_ci(r.ci_low, r.ci_high)}</td>"
        f"<td class=\"num\">{fmt(r.p_value, 3)}</td></tr>"
        for r in alert.compare)
    body = [f"<h1>Alert #{alert.id}: {escape(alert.summary or alert.kind)}</h1>",
            f'<table id="alert-meta">{meta_html}</table>',
            "<h2>Compared with the baseline</h2>",
            '<table id="compare"><tr><th>metric</th><th>baseline median</th><th>new median</th>'
            f"<th>ratio new/baseline</th><th>95% CI of the ratio</th><th>p</th></tr>{compare}</table>"]
    if alert.attribution:
        rows = "".join(f"<tr><td>{escape(r.kernel)}</td><td class=\"num\">{fmt(r.baseline_ms)}</td>"
                       f"<td class=\"num\">{fmt(r.candidate_ms)}</td><td class=\"num\">{fmt(r.delta_ms)}</td>"
                       f"<td class=\"num\">{'—' if r.share is None else f'{100 * r.share:.1f}%'}</td>"
                       f"<td>{share_bar(r.share)}</td></tr>" for r in alert.attribution)
        body += ["<h2>Kernel attribution</h2>",
                 '<table id="attribution"><tr><th>kernel</th><th>baseline (ms)</th><th>new (ms)</th>'
                 "<th>change (ms)</th><th>share of the change</th>"
                 f"<th></th></tr>{rows}</table>"]
    if alert.images:
        figures = "".join(
            f"<figure><figcaption>{side}</figcaption>"
            + (f'<img class="alert-image" src="{escape(href)}" alt="{side}">' if href else
               f'<p class="muted">image not found: {escape(alert.images[side])}</p>') + "</figure>"
            for side, href in images.items())
        body += ["<h2>Image before and after</h2>", f'<div class="images">{figures}</div>']
    other = {k: v for k, v in alert.detail.items() if k not in ("attribution", "images", "metrics")}
    if other:
        body += ["<h2>Detail</h2>", f"<pre>{escape(json.dumps(other, indent=2, sort_keys=True, default=str))}</pre>"]
    return _page(f"Alert #{alert.id}", "".join(body), root="../")


# ---- the whole site --------------------------------------------------------------------------


def build_site(session_factory: Callable[[], Session], out_dir: Path | str, *,
               image_root: Path | str | None = None) -> Path:
    """Write the dashboard into `out_dir` and return its index.html. Relative image paths in an
    alert's detail are read under `image_root` (the farm's data directory). The alerts/ and
    images/ folders inside `out_dir` are the site's own and are rewritten whole."""
    out = Path(out_dir)
    root = Path(image_root) if image_root is not None else None
    with session_factory() as session:
        data = read_site_data(session)
    out.mkdir(parents=True, exist_ok=True)
    for owned in ("alerts", "images"):
        shutil.rmtree(out / owned, ignore_errors=True)
    (out / "alerts").mkdir()
    for alert in data.alerts:
        images = {side: _copy_image(path, root, out, f"alert-{alert.id}-{side}") for side, path in alert.images.items()}
        (out / _alert_href(alert.id)).write_text(render_alert(alert, images), encoding="utf-8")
    index = out / "index.html"
    index.write_text(render_index(data), encoding="utf-8")
    return index
