"""Writes the Grafana dashboards of dashboards/*.json from the plain dictionaries below, so the
JSON is reproducible and reviewed as code: `python dashboards/make_dashboards.py` rewrites
them, and tests/orchestrator/test_dashboards_grafana.py checks the committed files equal its
output, that they conform to Grafana 11.6's dashboard schema (grafana-foundation-sdk and
@grafana/schema), that every panel reads the provisioned PostgreSQL datasource, and that every SQL query
runs against a migrated store.

The dashboards target the Grafana pinned in docker-compose.yml (11.6, dashboard schemaVersion
41) and read the store's tables directly (orchestrator/store/models.py). Medians come from
PostgreSQL's percentile_cont over the raw samples. Latency is plotted against the build's
`created` time, which orders builds the way regression analysis does. Template variables are
interpolated the Grafana way: a multi-value variable becomes a quoted, comma-separated list
(`IN ($device)`); a single-value text variable is inserted raw (so it is quoted in the SQL:
`'$metric'`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GRAFANA_VERSION = "11.6.0"
SCHEMA_VERSION = 41
# The datasource of dashboards/provisioning/datasources/devicefarm.yaml.
DATASOURCE = {"type": "grafana-postgresql-datasource", "uid": "devicefarm-postgres"}
# Options several panels share: a compact table, and a time series' legend below it with a
# tooltip that lists every series.
TABLE_OPTIONS = {"showHeader": True, "cellHeight": "sm"}
LEGEND_BELOW = {"legend": {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "none"}}


# ---- building blocks ----------------------------------------------------------------------


def target(sql: str, fmt: str = "table", ref: str = "A") -> dict[str, Any]:
    """One raw-SQL query of the PostgreSQL datasource."""
    return {"datasource": DATASOURCE, "editorMode": "code", "format": fmt, "rawQuery": True, "rawSql": sql.strip(),
            "refId": ref}


# Keys Grafana 11.6's panel schemas require (CUE fields with a default, which @grafana/schema types as
# required), with those defaults; a panel's own options and custom field config take precedence.
SCHEMA_REQUIRED: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # kind: (options, custom field config)
    "barchart": ({"barWidth": 0.97, "fullHighlight": False, "groupWidth": 0.7, "xTickLabelMaxLength": 0}, {}),
    "stat": ({"justifyMode": "auto", "orientation": "auto", "percentChangeColorMode": "standard",
              "showPercentChange": False, "wideLayout": True}, {}),
    "table": ({"frameIndex": 0}, {"align": "auto", "cellOptions": {"type": "auto"}, "inspect": False}),
}


def panel(pid: int, kind: str, title: str, grid: tuple[int, int, int, int], targets: list[dict], *,
          description: str = "", unit: str | None = None, options: dict | None = None,
          custom: dict | None = None, overrides: list | None = None, transformations: list | None = None,
          repeat: str | None = None) -> dict[str, Any]:
    x, y, w, h = grid
    required_options, required_custom = SCHEMA_REQUIRED.get(kind, ({}, {}))
    options = {**required_options, **(options or {})}
    defaults: dict[str, Any] = {"custom": {**required_custom, **(custom or {})}}
    if unit:
        defaults["unit"] = unit
    out: dict[str, Any] = {
        "id": pid, "type": kind, "title": title, "description": description, "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": w, "h": h}, "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": options, "pluginVersion": GRAFANA_VERSION,
    }
    if transformations:
        out["transformations"] = transformations
    if repeat:
        out["repeat"] = repeat
        out["repeatDirection"] = "v"
    return out


def query_variable(name: str, label: str, sql: str, *, multi: bool, include_all: bool) -> dict[str, Any]:
    return {"type": "query", "name": name, "label": label, "datasource": DATASOURCE, "query": sql.strip(), "refresh": 1, "sort": 1, "multi": multi, "includeAll": include_all,
            "options": [], "hide": 0, "skipUrlSync": False, "regex": ""}


def custom_variable(name: str, label: str, values: list[str]) -> dict[str, Any]:
    return {"type": "custom", "name": name, "label": label, "query": ",".join(values), "multi": True,
            "includeAll": True, "current": {"text": ["All"], "value": ["$__all"]},
            "options": [{"text": v, "value": v, "selected": False} for v in values], "hide": 0,
            "skipUrlSync": False}


def stat_options(*, values: bool, color_mode: str = "value") -> dict[str, Any]:
    """A stat panel's options: a value per row of the query (values=True), or each field's last
    non-null value, shown with its name."""
    return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": values},
            "textMode": "value_and_name", "colorMode": color_mode, "graphMode": "none"}


def dashboard(uid: str, title: str, description: str, panels: list[dict], variables: list[dict], *,
              annotations: list[dict] | None = None, time_from: str = "now-90d") -> dict[str, Any]:
    return {
        "uid": uid, "title": title, "description": description, "tags": ["devicefarm"],
        "editable": False, "graphTooltip": 1, "timezone": "utc", "refresh": "5m",
        "time": {"from": time_from, "to": "now"},
        "timepicker": {"hidden": False, "refresh_intervals": ["1m", "5m", "15m", "1h"]},
        "schemaVersion": SCHEMA_VERSION, "version": 1, "fiscalYearStartMonth": 0, "liveNow": False,
        "weekStart": "", "links": [], "panels": panels, "templating": {"list": variables},
        "annotations": {"list": annotations or []},
    }


DEVICE_VARIABLE_SQL = "SELECT serial AS __text, id AS __value FROM devices ORDER BY serial"


def device_variable(*, multi: bool) -> dict[str, Any]:
    return query_variable("device", "Device", DEVICE_VARIABLE_SQL, multi=multi, include_all=multi)


# ---- (a) latency over builds ----------------------------------------------------------------

# A series as the regression analysis keys it (orchestrator/analysis/regressions.py SpecKey.of and
# series_key): the job's kind, model, resolution ("WIDTHxHEIGHT", else "native"), steps,
# precision and profile, from the job's spec with the analysis' defaults; only succeeded runs
# count. The environment (OS, driver, adapter, WebGPU runtime) is the rest of the key: its changes
# are annotations, so a step at a driver update reads as one.
SPEC_COLUMNS = {
    "model": "coalesce(j.spec->>'model', '')",
    "resolution": "CASE WHEN coalesce(j.spec->>'width', '') NOT IN ('', '0') AND coalesce(j.spec->>'height', '') "
                  "NOT IN ('', '0') THEN (j.spec->>'width') || 'x' || (j.spec->>'height') ELSE 'native' END",
    "steps": "coalesce(j.spec->>'steps', '20')",
    "precision": "coalesce(j.spec->>'precision', 'fp16')",
    "profile": "coalesce(j.spec->>'profile', 'auto')",
}
SERIES_FILTER = "j.kind = '$kind' AND r.status = 'succeeded'" + "".join(
    f"\n    AND {column} IN (${name})" for name, column in SPEC_COLUMNS.items())


def run_medians_sql(metric: str, per_build_only: bool = False) -> str:
    """Per run of the selected series on $device: the median of its samples of `metric`."""
    run_id = "" if per_build_only else " r.id AS run_id,"
    return f"""
WITH run_medians AS (
  SELECT r.build_id,{run_id} percentile_cont(0.5) WITHIN GROUP (ORDER BY s.value) AS run_median
  FROM samples s
  JOIN runs r ON r.id = s.run_id
  JOIN jobs j ON j.id = r.job_id
  WHERE r.device_id IN ($device) AND s.metric = {metric} AND r.build_id IS NOT NULL
    AND {SERIES_FILTER}
  GROUP BY r.build_id, r.id
)"""


# Per run: the median of its samples of the metric; per build: the median, lowest and highest of
# those run medians, placed at the build's creation time (builds ordered as analysis orders them).
def latency_by_build_sql(metric: str) -> str:
    return run_medians_sql(metric) + """
SELECT b.created AS "time",
       percentile_cont(0.5) WITHIN GROUP (ORDER BY m.run_median) AS "median",
       min(m.run_median) AS "lowest run",
       max(m.run_median) AS "highest run"
FROM run_medians m
JOIN builds b ON b.id = m.build_id
WHERE $__timeFilter(b.created)
GROUP BY b.id, b.created
ORDER BY b.created
"""


LATENCY_BY_BUILD_SQL = latency_by_build_sql("'$metric'")
MEMORY_BY_BUILD_SQL = latency_by_build_sql("'peak_gpu_bytes'")

LATENCY_BARS_SQL = run_medians_sql("'$metric'", per_build_only=True) + """
SELECT b.name AS "build",
       percentile_cont(0.5) WITHIN GROUP (ORDER BY m.run_median) AS "median",
       count(*) AS "runs"
FROM run_medians m
JOIN builds b ON b.id = m.build_id
WHERE $__timeFilter(b.created)
GROUP BY b.id, b.name, b.created
ORDER BY b.created, b.id
"""

# Alerts on the device and metric, marked at the creation time of the build they blame.
LATENCY_ALERTS_SQL = """
SELECT b.created AS "time",
       a.kind || ' #' || a.id || ' (' || a.state || '): ' || a.summary AS "text",
       a.kind || ',' || a.state AS "tags"
FROM alerts a
JOIN builds b ON b.id = a.build_id
WHERE a.device_id IN ($device) AND (a.metric = '$metric' OR a.metric = '')
  AND $__timeFilter(b.created)
ORDER BY b.created
"""

# The first run of each environment on a device (its OS, driver, adapter or WebGPU runtime
# changed): a new series begins there.
ENVIRONMENT_CHANGES_SQL = """
SELECT first_run AS "time",
       d.serial || ': environment ' || e.env_key || ' (' || e.os_driver || ')' AS "text",
       'environment' AS "tags"
FROM (
  SELECT r.device_id, r.env_key, min(r.finished_at) AS first_run,
         max(trim(coalesce(r.environment->>'os', '') || ' ' || coalesce(r.environment->>'os_version', ''))
             || ' / ' || coalesce(r.environment->>'driver', '')) AS os_driver
  FROM runs r
  WHERE r.device_id IN ($device) AND r.env_key <> '' AND r.finished_at IS NOT NULL
  GROUP BY r.device_id, r.env_key
) e
JOIN devices d ON d.id = e.device_id
WHERE $__timeFilter(e.first_run)
ORDER BY first_run
"""

KIND_VARIABLE_SQL = """
SELECT DISTINCT j.kind FROM jobs j JOIN runs r ON r.job_id = j.id
WHERE r.device_id IN ($device) ORDER BY j.kind
"""


def spec_variable_sql(name: str) -> str:
    """The values of one part of the series key among $device's runs of $kind (and the parts before it)."""
    before = list(SPEC_COLUMNS)[:list(SPEC_COLUMNS).index(name)]
    narrowed = "".join(f"\n  AND {SPEC_COLUMNS[b]} IN (${b})" for b in before)
    return f"""
SELECT DISTINCT {SPEC_COLUMNS[name]} AS "__text", {SPEC_COLUMNS[name]} AS "__value"
FROM jobs j JOIN runs r ON r.job_id = j.id
WHERE r.device_id IN ($device) AND j.kind = '$kind'{narrowed}
ORDER BY 1
"""


METRIC_VARIABLE_SQL = f"""
SELECT DISTINCT s.metric FROM samples s JOIN runs r ON r.id = s.run_id JOIN jobs j ON j.id = r.job_id
WHERE r.device_id IN ($device) AND s.unit = 'ms'
  AND {SERIES_FILTER}
ORDER BY s.metric
"""


def series_variables() -> list[dict[str, Any]]:
    """Device, then the series key's parts, each narrowing the next, then the metric."""
    kind = query_variable("kind", "Job kind", KIND_VARIABLE_SQL, multi=False, include_all=False)
    kind["description"] = "The analysis compares latency jobs' samples; a generate job's single runs are their own series."
    return [device_variable(multi=True), kind,
            *[query_variable(name, name.capitalize(), spec_variable_sql(name), multi=True, include_all=False)
              for name in SPEC_COLUMNS],
            query_variable("metric", "Metric (ms)", METRIC_VARIABLE_SQL, multi=False, include_all=False)]


def latency_dashboard() -> dict[str, Any]:
    def band(color: str) -> list[dict[str, Any]]:
        fixed = {"id": "color", "value": {"mode": "fixed", "fixedColor": color}}
        return [
            {"matcher": {"id": "byName", "options": "highest run"},
             "properties": [{"id": "custom.fillBelowTo", "value": "lowest run"}, {"id": "custom.lineWidth", "value": 0},
                            {"id": "custom.fillOpacity", "value": 20}, fixed]},
            {"matcher": {"id": "byName", "options": "lowest run"},
             "properties": [{"id": "custom.lineWidth", "value": 0}, fixed]},
        ]
    line = {"drawStyle": "line", "showPoints": "always", "pointSize": 6, "lineWidth": 2, "spanNulls": True,
            "fillOpacity": 0}
    panels = [
        panel(1, "timeseries", "$metric on $device over builds", (0, 0, 16, 9),
              [target(LATENCY_BY_BUILD_SQL)], repeat="device", unit="ms",
              description="One series as the analysis keys it (job kind, model, resolution, steps, precision, "
                          "profile): one point per build at its creation time, the median of the per-run "
                          "medians, in a band from the lowest to the highest run median. Alerts and "
                          "environment changes are annotations.",
              custom=line, overrides=band("blue"), options=LEGEND_BELOW),
        panel(2, "barchart", "$metric on $device by build", (16, 0, 8, 9), [target(LATENCY_BARS_SQL)],
              repeat="device", unit="ms", description="The median per build, builds in creation order.",
              options={"xField": "build", "orientation": "vertical", "showValue": "auto", "stacking": "none",
                       "legend": {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": False},
                       "tooltip": {"mode": "single", "sort": "none"}, "xTickLabelRotation": -45,
                       "xTickLabelMaxLength": 24}),
        panel(3, "timeseries", "Peak GPU memory on $device over builds", (0, 9, 16, 8),
              [target(MEMORY_BY_BUILD_SQL)], repeat="device", unit="bytes",
              description="peak_gpu_bytes of the same series: the median per build of the runs' peaks.",
              custom=line, overrides=band("purple"), options=LEGEND_BELOW),
    ]
    annotations = [
        {"name": "Alerts", "datasource": DATASOURCE, "enable": True, "hide": False, "iconColor": "red",
         "target": target(LATENCY_ALERTS_SQL, ref="Alerts")},
        {"name": "Environment changes", "datasource": DATASOURCE, "enable": True, "hide": False,
         "iconColor": "orange", "target": target(ENVIRONMENT_CHANGES_SQL, ref="Environments")},
    ]
    return dashboard("devicefarm-latency", "devicefarm / latency over builds",
                     "Per device, one series as the analysis keys it: how each build measured, with the alerts "
                     "analysis raised and the environment changes that start a new series.", panels,
                     series_variables(), annotations=annotations, time_from="now-180d")


# ---- (b) per-kernel breakdown ---------------------------------------------------------------

# Kernel time per timed repetition: a kernel's total_ms summed per (run, repetition), then
# averaged over the repetitions of the build's runs on the device.
KERNELS_BY_BUILD_SQL = """
WITH per_repetition AS (
  SELECT r.build_id, kt.run_id, kt.repetition, kt.kernel, sum(kt.total_ms) AS ms, sum(kt.calls) AS calls
  FROM kernel_timings kt
  JOIN runs r ON r.id = kt.run_id
  WHERE r.device_id = $device AND r.build_id IS NOT NULL
  GROUP BY r.build_id, kt.run_id, kt.repetition, kt.kernel
)
SELECT b.name AS "build", p.kernel AS "kernel", avg(p.ms) AS "ms per repetition"
FROM per_repetition p
JOIN builds b ON b.id = p.build_id
WHERE $__timeFilter(b.created)
GROUP BY b.id, b.name, b.created, p.kernel
ORDER BY b.created, b.id, p.kernel
"""

KERNELS_TABLE_SQL = """
WITH per_repetition AS (
  SELECT r.build_id, kt.run_id, kt.repetition, kt.kernel, sum(kt.total_ms) AS ms, sum(kt.calls) AS calls
  FROM kernel_timings kt
  JOIN runs r ON r.id = kt.run_id
  WHERE r.device_id = $device AND r.build_id IS NOT NULL
  GROUP BY r.build_id, kt.run_id, kt.repetition, kt.kernel
)
SELECT b.name AS "build", b.created AS "created", p.kernel AS "kernel",
       avg(p.ms) AS "ms per repetition", avg(p.calls) AS "calls per repetition",
       sum(p.ms) AS "total ms", count(DISTINCT p.run_id) AS "runs"
FROM per_repetition p
JOIN builds b ON b.id = p.build_id
WHERE $__timeFilter(b.created)
GROUP BY b.id, b.name, b.created, p.kernel
ORDER BY b.created DESC, "ms per repetition" DESC
"""

KERNELS_OVER_TIME_SQL = """
WITH per_repetition AS (
  SELECT r.build_id, kt.run_id, kt.repetition, kt.kernel, sum(kt.total_ms) AS ms
  FROM kernel_timings kt
  JOIN runs r ON r.id = kt.run_id
  WHERE r.device_id = $device AND r.build_id IS NOT NULL
  GROUP BY r.build_id, kt.run_id, kt.repetition, kt.kernel
)
SELECT b.created AS "time", p.kernel AS "metric", avg(p.ms) AS "value"
FROM per_repetition p
JOIN builds b ON b.id = p.build_id
WHERE $__timeFilter(b.created)
GROUP BY b.created, p.kernel
ORDER BY b.created, p.kernel
"""


def kernels_dashboard() -> dict[str, Any]:
    matrix = [{"id": "groupingToMatrix", "options": {"rowField": "build", "columnField": "kernel",
                                                     "valueField": "ms per repetition", "emptyValue": "zero"}}]
    panels = [
        panel(1, "barchart", "Kernel time per repetition by build on $device", (0, 0, 24, 10),
              [target(KERNELS_BY_BUILD_SQL)], unit="ms", transformations=matrix,
              description="Stacked: every kernel's share of one timed repetition, builds in creation order.",
              options={"xField": "build\\kernel", "orientation": "vertical", "stacking": "normal",
                       "showValue": "never", "legend": {"calcs": [], "displayMode": "table", "placement": "right",
                                                        "showLegend": True},
                       "tooltip": {"mode": "multi", "sort": "desc"}, "xTickLabelRotation": -45}),
        panel(2, "timeseries", "Kernels over builds on $device", (0, 10, 24, 9),
              [target(KERNELS_OVER_TIME_SQL, fmt="time_series")], unit="ms",
              custom={"drawStyle": "line", "showPoints": "always", "lineWidth": 1, "spanNulls": True},
              options={"legend": {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True},
                       "tooltip": {"mode": "multi", "sort": "desc"}}),
        panel(3, "table", "Kernel timings per build on $device", (0, 19, 24, 10), [target(KERNELS_TABLE_SQL)],
              options=TABLE_OPTIONS),
    ]
    return dashboard("devicefarm-kernels", "devicefarm / per-kernel breakdown",
                     "Where a device's time goes, kernel by kernel, build by build.", panels,
                     [device_variable(multi=False)], time_from="now-180d")


# ---- (c) device health and cool-down ----------------------------------------------------------

DEVICES_SQL = """
SELECT d.serial AS "device", d.model AS "model", d.state AS "state", d.state_reason AS "reason",
       h.name AS "host", d.last_seen AS "last seen",
       extract(epoch FROM now() - d.last_seen) AS "seconds since seen",
       d.gpu_device AS "gpu", d.gpu_driver AS "driver", d.lease_holder AS "lease holder"
FROM devices d
LEFT JOIN hosts h ON h.id = d.host_id
WHERE d.id IN ($device)
ORDER BY d.serial
"""

STATE_COUNTS_SQL = """
SELECT d.state AS "state", count(*) AS "devices"
FROM devices d
WHERE d.id IN ($device)
GROUP BY d.state
ORDER BY d.state
"""

COOLDOWN_TIMED_OUT_SQL = """
SELECT count(*) FILTER (WHERE r.cooldown_timed_out) AS "cool-down timed out",
       count(*) AS "runs"
FROM runs r
WHERE r.device_id IN ($device) AND $__timeFilter(r.finished_at)
"""

COOLDOWN_WAITS_SQL = """
SELECT r.finished_at AS "time", d.serial AS "metric", r.cooldown_wait_s AS "value"
FROM runs r
JOIN devices d ON d.id = r.device_id
WHERE r.device_id IN ($device) AND r.cooldown_wait_s IS NOT NULL AND $__timeFilter(r.finished_at)
ORDER BY r.finished_at
"""

THERMAL_SQL = """
SELECT r.finished_at AS "time", d.serial || ' ' || t.phase AS "metric", max(t.celsius) AS "value"
FROM thermal_readings t
JOIN runs r ON r.id = t.run_id
JOIN devices d ON d.id = r.device_id
WHERE r.device_id IN ($device) AND $__timeFilter(r.finished_at)
GROUP BY r.id, r.finished_at, d.serial, t.phase
ORDER BY r.finished_at
"""

LATEST_THERMAL_SQL = """
SELECT DISTINCT ON (d.id, t.phase, t.zone)
       d.serial AS "device", t.phase AS "phase", t.zone AS "zone", t.celsius AS "celsius",
       r.finished_at AS "measured", r.cooldown_wait_s AS "cool-down wait s",
       r.cooldown_timed_out AS "cool-down timed out"
FROM thermal_readings t
JOIN runs r ON r.id = t.run_id
JOIN devices d ON d.id = r.device_id
WHERE r.device_id IN ($device)
ORDER BY d.id, t.phase, t.zone, r.finished_at DESC NULLS LAST, r.id DESC
"""


def health_dashboard() -> dict[str, Any]:
    state_colors = {"available": "green", "busy": "yellow", "offline": "red", "unauthorized": "red",
                    "quarantined": "purple"}
    state_mapping = [{"type": "value", "options": {s: {"text": s, "color": c, "index": i}
                                                   for i, (s, c) in enumerate(state_colors.items())}}]
    state_override = [{"matcher": {"id": "byName", "options": "state"},
                       "properties": [{"id": "mappings", "value": state_mapping},
                                      {"id": "custom.cellOptions", "value": {"type": "color-background"}}]}]
    line = {"drawStyle": "line", "showPoints": "always", "lineWidth": 1, "spanNulls": False}
    panels = [
        panel(1, "table", "Devices", (0, 0, 18, 8), [target(DEVICES_SQL)], overrides=state_override,
              options=TABLE_OPTIONS),
        panel(2, "stat", "Devices by state", (18, 0, 6, 4), [target(STATE_COUNTS_SQL)],
              options=stat_options(values=True, color_mode="background")),
        panel(3, "stat", "Runs whose cool-down timed out", (18, 4, 6, 4), [target(COOLDOWN_TIMED_OUT_SQL)],
              description="Kept out of regression comparisons by default.",
              options=stat_options(values=False)),
        panel(4, "timeseries", "Cool-down wait before each run", (0, 8, 12, 9),
              [target(COOLDOWN_WAITS_SQL, fmt="time_series")], unit="s", custom=line, options=LEGEND_BELOW),
        panel(5, "timeseries", "Hottest thermal zone before and after each run", (12, 8, 12, 9),
              [target(THERMAL_SQL, fmt="time_series")], unit="celsius", custom=line, options=LEGEND_BELOW),
        panel(6, "table", "Latest reading per thermal zone", (0, 17, 24, 8), [target(LATEST_THERMAL_SQL)],
              options=TABLE_OPTIONS),
    ]
    return dashboard("devicefarm-health", "devicefarm / device health and cool-down",
                     "Which devices are usable, when they were last seen, and how hot they ran.", panels,
                     [device_variable(multi=True)], time_from="now-30d")


# ---- (d) alerts ------------------------------------------------------------------------------

ALERTS_SQL = """
SELECT a.id AS "alert", a.state AS "state", a.kind AS "kind", d.serial AS "device", b.name AS "build",
       bb.name AS "baseline", a.metric AS "metric", a.ratio AS "ratio", a.ci_low AS "ci low",
       a.ci_high AS "ci high", a.p_value AS "p", a.summary AS "summary", a.note AS "note",
       a.created_at AS "created", a.updated_at AS "updated"
FROM alerts a
LEFT JOIN devices d ON d.id = a.device_id
LEFT JOIN builds b ON b.id = a.build_id
LEFT JOIN builds bb ON bb.id = a.baseline_build_id
WHERE a.state IN ($state) AND a.kind IN ($kind) AND $__timeFilter(a.created_at)
ORDER BY a.created_at DESC, a.id DESC
"""

ALERT_COUNTS_SQL = """
SELECT a.kind AS "kind", count(*) AS "alerts"
FROM alerts a
WHERE a.state IN ($state) AND a.kind IN ($kind) AND $__timeFilter(a.created_at)
GROUP BY a.kind
ORDER BY a.kind
"""


# Where the farm API (`farm api serve`, docker-compose's api service) answers a browser: each
# alert row links to its page there (trend, samples, kernels, images, triage buttons).
FARM_URL = "http://localhost:8090"


def textbox_variable(name: str, label: str, default: str, description: str) -> dict[str, Any]:
    return {"type": "textbox", "name": name, "label": label, "description": description, "query": default,
            "current": {"text": default, "value": default}, "options": [{"text": default, "value": default,
                                                                          "selected": True}],
            "hide": 0, "skipUrlSync": False}


def alerts_dashboard() -> dict[str, Any]:
    ratio_override = [{"matcher": {"id": "byRegexp", "options": "^(ratio|ci low|ci high)$"},
                       "properties": [{"id": "decimals", "value": 3}]},
                      {"matcher": {"id": "byName", "options": "p"},
                       "properties": [{"id": "decimals", "value": 4}]},
                      {"matcher": {"id": "byName", "options": "alert"},
                       "properties": [{"id": "links", "value": [
                           {"title": "Alert #${__value.raw} in the farm (trend, samples, kernels, images, triage)",
                            "url": "${farm_url}/alerts/${__value.raw}", "targetBlank": True}]}]}]
    panels = [
        panel(1, "stat", "Alerts by kind", (0, 0, 24, 4), [target(ALERT_COUNTS_SQL)],
              options=stat_options(values=True)),
        panel(2, "table", "Alerts", (0, 4, 24, 16), [target(ALERTS_SQL)], overrides=ratio_override,
              description="ratio = new median / baseline median, with its bootstrap confidence interval. "
                          "An alert's number opens its page in the farm (set Farm API above), where it is "
                          "triaged; or `farm regressions ack | invalidate | fixed`.",
              options={"showHeader": True, "cellHeight": "sm",
                       "sortBy": [{"displayName": "created", "desc": True}]}),
    ]
    return dashboard("devicefarm-alerts", "devicefarm / alerts",
                     "What the regression analysis found, and where triage stands.", panels,
                     [custom_variable("state", "State", ["new", "acknowledged", "invalid", "fixed"]),
                      custom_variable("kind", "Kind", ["regression", "improvement", "fidelity", "data_stoppage"]),
                      textbox_variable("farm_url", "Farm API", FARM_URL,
                                       "Where `farm api serve` answers: each alert links to its page there.")],
                     time_from="now-90d")


# ---- output --------------------------------------------------------------------------------


def dashboards() -> dict[str, dict[str, Any]]:
    """{file name: dashboard} of every dashboard this script writes."""
    return {
        "latency.json": latency_dashboard(),
        "kernels.json": kernels_dashboard(),
        "device-health.json": health_dashboard(),
        "alerts.json": alerts_dashboard(),
    }


def render(board: dict[str, Any]) -> str:
    return json.dumps(board, indent=2, sort_keys=False) + "\n"


def main(out_dir: Path = HERE) -> None:
    for name, board in dashboards().items():
        (out_dir / name).write_text(render(board))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
