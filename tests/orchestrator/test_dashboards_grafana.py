"""The Grafana dashboards of dashboards/: the committed JSON is what dashboards/make_dashboards.py
writes, every dashboard has the shape the dashboard schema of the Grafana that compose runs
expects, every panel, query and annotation reads the datasource dashboards/provisioning/
provisions, and every SQL query (panels, annotations, template variables) runs against a
migrated PostgreSQL store holding a little data and returns rows, with Grafana's macros and
variables interpolated the way Grafana does it. A column or table typo fails here, not on a
dashboard.

The shape check is written out below from the dashboard JSON schema of grafana-foundation-sdk
for Grafana 11.6 (required keys, allowed keys, enums and ranges); the schema file itself does
not ship in the SDK's wheel, so it is not read at test time. One deliberate departure: an
annotation's `target` holds the datasource query (rawSql), which is how Grafana 11 stores SQL
annotations, whereas the SDK schema describes only the built-in Grafana annotation target."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import re
from pathlib import Path

import pytest
from ruamel.yaml import YAML
from sqlalchemy import text

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
PROVISIONING = DASHBOARDS / "provisioning"


def load_generator():
    spec = importlib.util.spec_from_file_location("make_dashboards", DASHBOARDS / "make_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = load_generator()


def committed() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def provisioned_datasource() -> dict:
    sources = [s for p in sorted((PROVISIONING / "datasources").glob("*.y*ml"))
               for s in (YAML(typ="safe").load(p.read_text()) or {}).get("datasources", [])]
    (source,) = [s for s in sources if s.get("type") in {"postgres", "grafana-postgresql-datasource"}]
    assert source.get("uid"), "the provisioned datasource needs a uid for dashboards to refer to"
    return {"type": source["type"], "uid": source["uid"]}


# ---- the files are the generator's output ----------------------------------------------------


def test_committed_dashboards_are_the_generators_output():
    generated = GEN.dashboards()
    assert set(committed()) == set(generated), "run: python dashboards/make_dashboards.py"
    for name, board in generated.items():
        assert (DASHBOARDS / name).read_text() == GEN.render(board), \
            f"dashboards/{name} differs from the generator: run python dashboards/make_dashboards.py"


def test_the_generator_targets_the_grafana_compose_runs():
    compose = YAML(typ="safe").load((REPO / "docker-compose.yml").read_text())
    image = compose["services"]["grafana"]["image"]
    assert image.split(":")[1] == GEN.GRAFANA_VERSION, f"compose runs {image}: regenerate for it"
    for name, board in committed().items():
        assert board["schemaVersion"] == GEN.SCHEMA_VERSION, name


def test_every_panel_query_and_annotation_uses_the_provisioned_datasource():
    source = provisioned_datasource()
    assert GEN.DATASOURCE == source
    for name, board in committed().items():
        refs = []
        for p in board["panels"]:
            refs += [(f"panel {p['title']}", p.get("datasource"))]
            refs += [(f"panel {p['title']} query {t['refId']}", t.get("datasource")) for t in p["targets"]]
        refs += [(f"annotation {a['name']}", a["datasource"]) for a in board["annotations"]["list"]]
        refs += [(f"annotation {a['name']} query", a["target"].get("datasource")) for a in board["annotations"]["list"]]
        refs += [(f"variable {v['name']}", v["datasource"]) for v in board["templating"]["list"] if v["type"] == "query"]
        assert refs, name
        wrong = [(where, ref) for where, ref in refs if ref != source]
        assert not wrong, f"{name}: not the provisioned datasource {source}: {wrong}"


# ---- the shape Grafana 11.6's dashboard schema describes ---------------------------------------

DASHBOARD_KEYS = {"id", "uid", "title", "description", "revision", "gnetId", "tags", "timezone", "editable",
                  "graphTooltip", "time", "timepicker", "fiscalYearStartMonth", "liveNow", "weekStart", "refresh",
                  "schemaVersion", "version", "panels", "templating", "annotations", "links", "snapshot"}
PANEL_KEYS = {"type", "id", "pluginVersion", "tags", "targets", "title", "description", "transparent", "datasource",
              "gridPos", "links", "repeat", "repeatDirection", "maxPerRow", "maxDataPoints", "transformations",
              "interval", "timeFrom", "timeShift", "hideTimeOverride", "libraryPanel", "options", "fieldConfig"}
FIELD_CONFIG_KEYS = {"displayName", "displayNameFromDS", "description", "path", "writeable", "filterable", "unit",
                     "decimals", "min", "max", "mappings", "thresholds", "color", "links", "noValue", "custom"}
VARIABLE_KEYS = {"type", "name", "label", "hide", "skipUrlSync", "description", "query", "datasource", "current",
                 "multi", "options", "refresh", "sort", "includeAll", "allValue", "regex", "definition"}
VARIABLE_TYPES = {"query", "adhoc", "constant", "datasource", "interval", "textbox", "custom", "system"}
ANNOTATION_KEYS = {"name", "datasource", "enable", "hide", "iconColor", "filter", "target", "type", "builtIn"}
# Panel plugins built into Grafana 11.6 that these dashboards may use.
PANEL_TYPES = {"timeseries", "barchart", "table", "stat", "text", "bargauge", "gauge", "state-timeline", "row"}
SQL_TARGET_KEYS = {"datasource", "editorMode", "format", "rawQuery", "rawSql", "refId"}


def shape_problems(board: dict) -> list[str]:
    """Everything in `board` the dashboard schema would refuse (see the module docstring)."""
    bad: list[str] = []

    def check(cond: bool, message: str) -> None:
        if not cond:
            bad.append(message)

    check(set(board) <= DASHBOARD_KEYS, f"unknown dashboard keys {set(board) - DASHBOARD_KEYS}")
    for key in ("schemaVersion", "templating", "annotations", "uid", "title"):
        check(key in board, f"missing {key}")
    check(isinstance(board.get("schemaVersion"), int), "schemaVersion is not an integer")
    check(re.fullmatch(r"[A-Za-z0-9_-]{8,40}", board.get("uid", "")) is not None, "uid is not 8-40 safe chars")
    check(board.get("graphTooltip", 0) in (0, 1, 2), "graphTooltip not in 0..2")
    check(set(board.get("time", {})) == {"from", "to"}, "time needs exactly from and to")
    picker = board.get("timepicker", {"hidden": False, "refresh_intervals": [], "time_options": []})
    check({"hidden", "refresh_intervals", "time_options"} <= set(picker), "timepicker misses a required key")
    check(all(isinstance(t, str) for t in board.get("tags", [])), "tags are not strings")
    check(set(board["templating"]) <= {"list"} and set(board["annotations"]) <= {"list"}, "templating/annotations")

    for v in board["templating"].get("list", []):
        where = f"variable {v.get('name')}"
        check(set(v) <= VARIABLE_KEYS, f"{where}: unknown keys {set(v) - VARIABLE_KEYS}")
        check(v.get("type") in VARIABLE_TYPES and isinstance(v.get("name"), str), f"{where}: type/name")
        check(v.get("hide", 0) in (0, 1, 2) and v.get("refresh", 0) in (0, 1, 2) and v.get("sort", 0) in range(9),
              f"{where}: hide/refresh/sort out of range")
        check(isinstance(v.get("query", ""), str | dict), f"{where}: query is neither text nor object")
        for option in [*v.get("options", []), *([v["current"]] if "current" in v else [])]:
            check({"text", "value"} <= set(option) <= {"text", "value", "selected"}, f"{where}: option {option}")
        check(set(v.get("datasource", {})) <= {"type", "uid"}, f"{where}: datasource ref")

    for a in board["annotations"].get("list", []):
        where = f"annotation {a.get('name')}"
        check(set(a) <= ANNOTATION_KEYS, f"{where}: unknown keys {set(a) - ANNOTATION_KEYS}")
        check({"name", "datasource", "enable", "iconColor"} <= set(a), f"{where}: misses a required key")
        check(set(a.get("datasource", {})) <= {"type", "uid"}, f"{where}: datasource ref")
        check(set(a.get("target", {})) <= SQL_TARGET_KEYS, f"{where}: target is not a SQL query")

    ids = [p.get("id") for p in board.get("panels", [])]
    check(len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids), f"panel ids not unique integers: {ids}")
    cells: dict[tuple[int, int], str] = {}
    for p in board.get("panels", []):
        where = f"panel {p.get('title')}"
        check(set(p) <= PANEL_KEYS, f"{where}: unknown keys {set(p) - PANEL_KEYS}")
        check(p.get("type") in PANEL_TYPES, f"{where}: panel type {p.get('type')} is not a built-in one")
        check(set(p.get("datasource", {})) <= {"type", "uid"}, f"{where}: datasource ref")
        check(p.get("repeatDirection", "h") in ("h", "v"), f"{where}: repeatDirection")
        if "repeat" in p:
            names = {v["name"] for v in board["templating"]["list"]}
            check(p["repeat"] in names, f"{where}: repeats over unknown variable {p['repeat']}")
        grid = p.get("gridPos", {})
        whole = all(isinstance(grid.get(k), int) for k in "hwxy")
        check(whole, f"{where}: gridPos needs integer h, w, x, y")
        if whole:
            check(grid["h"] > 0 and 0 < grid["w"] <= 24 and 0 <= grid["x"] < 24 and grid["x"] + grid["w"] <= 24,
                  f"{where}: gridPos {grid} outside the 24-column grid")
            for x in range(grid["x"], grid["x"] + grid["w"]):
                for y in range(grid["y"], grid["y"] + grid["h"]):
                    check((x, y) not in cells, f"{where} overlaps {cells.get((x, y))}")
                    cells[(x, y)] = where
        fc = p.get("fieldConfig", {})
        check(set(fc) == {"defaults", "overrides"}, f"{where}: fieldConfig needs defaults and overrides")
        check(set(fc.get("defaults", {})) <= FIELD_CONFIG_KEYS, f"{where}: unknown field config keys")
        for o in fc.get("overrides", []):
            check(set(o) == {"matcher", "properties"} and "id" in o["matcher"], f"{where}: override {o}")
            check(all("id" in prop for prop in o.get("properties", [])), f"{where}: override property without id")
        for t in p.get("transformations", []):
            check({"id", "options"} <= set(t), f"{where}: transformation needs id and options")
        check(bool(p.get("targets")), f"{where}: no query")
        refs = [t.get("refId") for t in p.get("targets", [])]
        check(len(refs) == len(set(refs)), f"{where}: duplicate refIds")
        for t in p.get("targets", []):
            check(set(t) <= SQL_TARGET_KEYS and t.get("format") in ("table", "time_series") and t.get("rawQuery"),
                  f"{where}: query {t.get('refId')} is not a raw SQL query")
    return bad


@pytest.mark.parametrize("name", sorted(GEN.dashboards()))
def test_dashboard_has_the_schema_shape(name):
    board = json.loads((DASHBOARDS / name).read_text())
    assert board["panels"] and board["title"].startswith("devicefarm")
    assert shape_problems(board) == []


def test_the_shape_check_catches_what_the_schema_refuses():
    """The check is not vacuous: each of these breaks the schema and is reported."""
    good = GEN.dashboards()["latency.json"]
    assert shape_problems(good) == []
    mutations = [
        lambda b: b.pop("schemaVersion"),
        lambda b: b.update(colour="blue"),
        lambda b: b["panels"][0].update(gridPos={"x": 20, "y": 0, "w": 8, "h": 4}),
        lambda b: b["panels"][0].update(type="graph-that-does-not-exist"),
        lambda b: b["panels"][1].update(id=b["panels"][0]["id"]),
        lambda b: b["templating"]["list"][0].update(type="dropdown"),
        lambda b: b["annotations"]["list"][0].pop("iconColor"),
        lambda b: b["panels"][0]["fieldConfig"].pop("overrides"),
    ]
    for i, mutate in enumerate(mutations):
        board = json.loads(json.dumps(good))
        mutate(board)
        assert shape_problems(board), f"mutation {i} went unnoticed"


# ---- every query runs on a migrated store ------------------------------------------------------

TIME_FROM = "2000-01-01T00:00:00Z"
TIME_TO = "2100-01-01T00:00:00Z"


def interpolate(sql: str, variables: dict[str, list[str]], board: dict) -> str:
    """Grafana's SQL interpolation: time macros, then $name / ${name} with multi-value and
    include-all variables as quoted comma lists and single values inserted raw."""
    sql = re.sub(r"\$__timeFilter\(([^)]+)\)", rf"\1 BETWEEN '{TIME_FROM}' AND '{TIME_TO}'", sql)
    sql = sql.replace("$__timeFrom()", f"'{TIME_FROM}'").replace("$__timeTo()", f"'{TIME_TO}'")
    multi = {v["name"]: v.get("multi") or v.get("includeAll") for v in board["templating"]["list"]}

    def value(match: re.Match) -> str:
        name = match[1] or match[2]
        if name not in variables:
            raise AssertionError(f"query uses ${name}, which is no variable of the dashboard (or not yet known)")
        values = variables[name]
        if multi[name]:
            return ",".join("'" + v.replace("'", "''") + "'" for v in values)
        return values[0]

    sql = re.sub(r"\$\{(\w+)\}|\$(\w+)", value, sql)
    assert "$" not in sql, f"an uninterpolated macro is left: {sql}"
    return sql


def seed(Session) -> None:  # noqa: N803  (a session factory)
    from orchestrator.db.models import (
        Alert,
        AlertKind,
        Build,
        Device,
        DeviceState,
        Host,
        Job,
        JobKind,
        KernelTiming,
        Run,
        RunStatus,
        Sample,
        ThermalReading,
        TransportKind,
    )

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    with Session() as s, s.begin():
        host = Host(name="lab-1", last_seen=t0)
        devices = [Device(serial=f"phone-{i}", transport=TransportKind.adb, host=host, model="Pixel",
                          state=DeviceState.available, last_seen=t0) for i in (1, 2)]
        builds = [Build(name=f"build-{i}", version=f"1.{i}", manifest_sha256=f"{i:064d}",
                        created=t0 + dt.timedelta(days=i)) for i in (1, 2)]
        s.add_all([host, *devices, *builds])
        s.flush()
        for device in devices:
            for i, build in enumerate(builds):
                job = Job(kind=JobKind.latency, spec={}, device_id=device.id, build_id=build.id)
                s.add(job)
                s.flush()
                run = Run(job_id=job.id, attempt=1, device_id=device.id, build_id=build.id, status=RunStatus.succeeded,
                          engine={}, artifacts=[], cooldown_wait_s=12.5, cooldown_timed_out=i == 1,
                          started_at=build.created, finished_at=build.created + dt.timedelta(minutes=5))
                s.add(run)
                s.flush()
                s.add_all([Sample(run_id=run.id, metric="unet_step_ms", unit="ms", value=100.0 + 10 * i + r,
                                  repetition=r) for r in range(5)])
                s.add_all([KernelTiming(run_id=run.id, kernel=k, calls=4, total_ms=ms * (1 + i), repetition=r)
                           for r in range(2) for k, ms in (("attention", 40.0), ("conv2d", 30.0))])
                s.add_all([ThermalReading(run_id=run.id, phase=phase, zone="gpu", celsius=40.0 + 5 * (phase == "after"))
                           for phase in ("before", "after")])
            s.add(Alert(kind=AlertKind.regression, device_id=device.id, build_id=builds[1].id,
                        baseline_build_id=builds[0].id, metric="unet_step_ms", series={"metric": "unet_step_ms"},
                        ratio=1.1, ci_low=1.05, ci_high=1.15, p_value=0.001, summary="unet_step_ms 10% slower",
                        detail={}))


def queries_of(board: dict) -> list[tuple[str, str, str]]:
    """(where, format, sql) of every panel query and annotation query."""
    out = [(f"panel {p['title']} / {t['refId']}", t["format"], t["rawSql"]) for p in board["panels"]
           for t in p["targets"]]
    out += [(f"annotation {a['name']}", a["target"]["format"], a["target"]["rawSql"])
            for a in board["annotations"]["list"]]
    return out


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("name", sorted(GEN.dashboards()))
def test_every_query_runs_against_a_migrated_store(name, db_engine, Session):  # noqa: N803
    seed(Session)
    board = json.loads((DASHBOARDS / name).read_text())
    variables: dict[str, list[str]] = {}
    with db_engine.connect() as conn:
        # Variables in order: a variable's query may use the ones before it, as in Grafana.
        for v in board["templating"]["list"]:
            if v["type"] == "custom":
                variables[v["name"]] = v["query"].split(",")
                continue
            result = conn.execute(text(interpolate(v["query"], variables, board)))
            columns = list(result.keys())
            rows = result.all()
            assert rows, f"{name}: variable {v['name']} has no values"
            column = columns.index("__value") if "__value" in columns else 0
            variables[v["name"]] = [str(r[column]) for r in rows]
        assert queries_of(board)
        for where, fmt, sql in queries_of(board):
            result = conn.execute(text(interpolate(sql, variables, board)))
            columns = list(result.keys())
            rows = result.all()
            assert rows, f"{name}: {where} returned no rows on a store that has data for it"
            if fmt == "time_series" or where.startswith("annotation"):
                assert columns[0] == "time" and isinstance(rows[0][0], dt.datetime), f"{name}: {where}: {columns}"
            if fmt == "time_series":
                assert set(columns) == {"time", "metric", "value"}, f"{name}: {where}: {columns}"
            if where.startswith("annotation"):
                assert "text" in columns, f"{name}: {where}: {columns}"


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_column_typo_fails_the_query_check(db_engine, Session):  # noqa: N803
    """What the test above relies on: PostgreSQL refuses a misspelt column."""
    from sqlalchemy.exc import ProgrammingError

    seed(Session)
    board = GEN.latency_dashboard()
    sql = board["panels"][0]["targets"][0]["rawSql"].replace("s.metric", "s.metrics")
    with db_engine.connect() as conn, pytest.raises(ProgrammingError, match="metrics"):
        conn.execute(text(interpolate(sql, {"device": ["1"], "metric": ["unet_step_ms"]}, board)))


def test_latency_band_overrides_name_real_columns():
    board = GEN.latency_dashboard()
    sql = board["panels"][0]["targets"][0]["rawSql"]
    for override in board["panels"][0]["fieldConfig"]["overrides"]:
        assert f'AS "{override["matcher"]["options"]}"' in sql
        for prop in override["properties"]:
            if prop["id"] == "custom.fillBelowTo":
                assert f'AS "{prop["value"]}"' in sql
