"""The Grafana dashboards of dashboards/: the committed JSON is what dashboards/make_dashboards.py
writes, every dashboard conforms to the dashboard schema of the Grafana that compose runs (11.6.0),
every panel, query and annotation reads the datasource dashboards/provisioning/ provisions, and
every SQL query (panels, annotations, template variables) runs against a migrated PostgreSQL store
holding a little data and returns rows, with Grafana's macros and variables interpolated the way
Grafana does it. A column or table typo fails here, not on a dashboard.

The schema is Grafana 11.6's, from two installed, versioned sources generated from it (the schema
files themselves ship in neither, and none is copied here); each test checks the version matches
GEN.GRAFANA_VERSION, and in CI (CI=true) a missing source fails rather than skips:

1. grafana-foundation-sdk 11.6.0 (pinned in pyproject.toml's `test` extra). Dashboard.from_json
   decodes the dashboard, panel options and custom field config by panel type through the SDK's
   registry of Grafana's built-in panels; to_json writes it back. from_json silently drops keys the
   schema does not have and does not check values, so the test (a) requires every key and value of
   the file to come back unchanged (keys the SDK adds are the schema's defaults), (b) checks every
   decoded value against the type the SDK declares for it (enums, literals, int, number, string,
   bool, lists, nested models; what the SDK leaves undecoded, a panel's transformations and links,
   is decoded and round-tripped too), (c) requires the panel type to be one the SDK's registry
   knows, and no custom field config where that panel's schema has none.
2. npm @grafana/schema 11.6.0 with typescript 5.7.3 (scripts/ensure-grafana-schema.sh installs
   both into .cache/grafana-schema): each dashboard becomes a TypeScript literal of the Dashboard
   type, every panel `satisfies` Panel, its options and custom field config the Options and
   FieldConfig of its panel type's schema, compiled by `tsc --strict`: an unknown key in any typed
   object is an excess-property error, a missing required key or a value of the wrong type or
   outside its enum a type error. String enums are written as their values (the Json<T> type).

What neither schema types, and so neither check covers: the queries of Grafana's PostgreSQL
datasource (Panel.targets is a list of arbitrary objects in the schema; the annotation target is
typed only as the built-in Grafana annotation query, the SDK's AnnotationTarget, which the SDK check
therefore skips). The TypeScript check types those queries with a hand-written SQLQuery that extends
the schema's DataQuery; the SQL itself is checked against PostgreSQL below. Nor do the schemas
type an override property's value or a transformation's options.

The hand-written shape check (shape_problems) stays alongside: it adds what the schema's types
cannot say (the uid pattern, the 24-column grid and overlaps, unique panel ids and refIds, a repeat
over a variable that exists, raw SQL queries only)."""

from __future__ import annotations

import datetime as dt
import enum
import importlib.metadata
import json
import re
import shutil
import subprocess
import types
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
from ci_support import missing
from ruamel.yaml import YAML
from script_support import load_script
from sqlalchemy import text

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
PROVISIONING = DASHBOARDS / "provisioning"


GEN = load_script("dashboards/make_dashboards.py")


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
                 "multi", "allowCustomValue", "options", "refresh", "sort", "includeAll", "allValue", "regex"}
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
    picker = board.get("timepicker", {})
    check(set(picker) <= {"hidden", "refresh_intervals", "quick_ranges", "nowDelay"}, "unknown timepicker keys")
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


# ---- Grafana 11.6's schema as grafana-foundation-sdk decodes it -------------------------------


def require(ok: bool, message: str) -> None:
    """A missing schema source skips locally but fails in CI, where it is a broken install."""
    if not ok:
        missing(message)


def foundation_sdk():
    try:
        version = importlib.metadata.version("grafana-foundation-sdk")
    except importlib.metadata.PackageNotFoundError:
        version = ""
    require(bool(version), "grafana-foundation-sdk is not installed: pip install -e '.[test]'")
    from grafana_foundation_sdk.cog import encoder, plugins, runtime, variants
    from grafana_foundation_sdk.models import dashboard

    # The SDK release is versioned `<build>!<Grafana version>`: it must be the Grafana compose runs.
    assert version.split("!")[-1] == GEN.GRAFANA_VERSION, f"grafana-foundation-sdk {version} is not for Grafana " \
        f"{GEN.GRAFANA_VERSION}: pin the matching release in pyproject.toml"
    plugins.register_default_plugins()  # the panel options and field configs of Grafana's built-in panels
    return SimpleNamespace(Dashboard=dashboard.Dashboard, JSONEncoder=encoder.JSONEncoder, runtime=runtime,
                           Dataquery=variants.Dataquery)


def lost_in_round_trip(original, decoded, path: str = "") -> list[str]:
    """Where `decoded` (what the SDK wrote back) lost or changed what `original` held. Keys the SDK
    adds are the schema's defaults and are fine; a key it drops is one the schema does not have."""
    if isinstance(original, dict):
        if not isinstance(decoded, dict):
            return [f"{path}: came back as {decoded!r:.80}"]
        return [problem for key, value in original.items()
                for problem in ([f"{path}.{key}: not in the schema (dropped)"] if key not in decoded
                                else lost_in_round_trip(value, decoded[key], f"{path}.{key}"))]
    if isinstance(original, list):
        if not isinstance(decoded, list) or len(decoded) != len(original):
            return [f"{path}: came back as {decoded!r:.80}"]
        return [problem for i, (a, b) in enumerate(zip(original, decoded, strict=True))
                for problem in lost_in_round_trip(a, b, f"{path}[{i}]")]
    if type(original) is not type(decoded) or original != decoded:
        return [f"{path}: {original!r:.80} came back as {decoded!r:.80}"]
    return []


def schema_type_problems(sdk, value, hint, path: str) -> list[str]:
    """Where `value` (decoded by the SDK) is not of the type the SDK declares for it; the
    declarations are generated from the schema: enums, literals, integers, numbers, strings,
    booleans, lists, objects and nested models. A nested model the SDK leaves undecoded (a panel's
    transformations and links) is decoded here and round-tripped too."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is object or hint is typing.Any:
        if hasattr(type(value), "from_json"):  # panel options / custom field config, decoded by panel type
            return schema_type_problems(sdk, value, type(value), path)
        return []  # the schema says nothing here (e.g. an override's value, a transformation's options)
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in args if a is not type(None)]
        if value is None:
            return [] if len(arms) < len(args) else [f"{path}: null where {hint} is expected"]
        exact = [arm for arm in arms if isinstance(arm, type) and type(value) is arm]  # a decoded model
        tries = [schema_type_problems(sdk, value, arm, path) for arm in exact or arms]
        return [] if any(not t for t in tries) else min(tries, key=len)
    if value is None:
        return [f"{path}: null where {getattr(hint, '__name__', hint)} is expected"]
    if origin is typing.Literal:
        return [] if value in args and not isinstance(value, bool) else [f"{path}: {value!r} is not one of {args}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: {value!r:.60} is not a list"]
        return [p for i, item in enumerate(value) for p in schema_type_problems(sdk, item, args[0], f"{path}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: {value!r:.60} is not an object"]
        return [p for k, item in value.items() for p in schema_type_problems(sdk, item, args[1], f"{path}.{k}")]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [m.value for m in hint]
        ok = not isinstance(value, bool) and isinstance(value, int | str) and value in values
        return [] if ok else [f"{path}: {value!r} is not one of {hint.__name__} {values}"]
    scalars = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}
    if hint in scalars:
        ok = isinstance(value, scalars[hint]) and (hint is bool or not isinstance(value, bool))
        return [] if ok else [f"{path}: {value!r:.60} is not {hint.__name__}"]
    if hint is sdk.Dataquery:
        return [] if isinstance(value, sdk.Dataquery) else [f"{path}: {value!r:.60} is not a query"]
    if isinstance(hint, type) and hasattr(hint, "from_json"):
        problems = []
        if isinstance(value, dict):  # left undecoded by its parent: decode it here
            decoded = hint.from_json(value)
            problems += lost_in_round_trip(value, json.loads(json.dumps(decoded, cls=sdk.JSONEncoder)), path)
            value = decoded
        if not isinstance(value, hint):
            return [f"{path}: {value!r:.60} is not a {hint.__name__}"]
        return problems + [p for name, attr in typing.get_type_hints(hint).items()
                           for p in schema_type_problems(sdk, getattr(value, name), attr, f"{path}.{name}")]
    return [f"{path}: the check does not know the type {hint!r}"]


# The schema's AnnotationTarget is the built-in Grafana annotation query only (the schema says
# "TODO.. this should just be a normal query target"); a SQL annotation's target is the
# datasource query, which Grafana 11 stores there. It is checked by the TypeScript check below.
ANNOTATION_TARGET = re.compile(r"\.annotations\.list\[\d+\]\.target(\.|$)")


def sdk_problems(sdk, board: dict) -> list[str]:
    """Everything in `board` that grafana-foundation-sdk (Grafana 11.6's schema) refuses."""
    board = json.loads(json.dumps(board))
    try:
        decoded = sdk.Dashboard.from_json(board)
        written = json.loads(json.dumps(decoded, cls=sdk.JSONEncoder))
        problems = [p for p in lost_in_round_trip(board, written) if not ANNOTATION_TARGET.search(p)]
        problems += schema_type_problems(sdk, decoded, sdk.Dashboard, "")
    except Exception as error:  # noqa: BLE001  (the SDK cannot even decode it)
        return [f"the SDK cannot decode the dashboard: {error!r}"]
    for p in board.get("panels", []):
        config = sdk.runtime.panelcfg_config(p.get("type", ""))
        if config is None and p.get("type") != "row":
            problems.append(f"panel {p.get('title')}: {p.get('type')} is no panel type of the schema")
        elif config and config.field_config_from_json_hook is None and p.get("fieldConfig", {}).get(
                "defaults", {}).get("custom"):
            problems.append(f"panel {p.get('title')}: {p['type']} has no custom field config in the schema")
    return problems


@pytest.mark.parametrize("name", sorted(GEN.dashboards()))
def test_dashboard_conforms_to_grafana_foundation_sdk_schema(name):
    """Decoded by the SDK's Dashboard.from_json (panel options and custom field config by panel
    type) and written back by to_json, nothing is lost or changed, and every decoded value has the
    type the SDK declares."""
    assert sdk_problems(foundation_sdk(), json.loads((DASHBOARDS / name).read_text())) == []


def stat_with_custom() -> dict:
    """A stat panel (whose schema has no custom field config) with a custom field config."""
    stat = next(p for p in GEN.health_dashboard()["panels"] if p["type"] == "stat")
    return GEN.panel(9, "stat", "stat", (0, 40, 6, 4), stat["targets"], options=stat["options"],
                     custom={"lineWidth": 1})


def test_the_sdk_check_catches_what_the_schema_refuses():
    sdk = foundation_sdk()
    good = GEN.dashboards()["latency.json"]
    assert sdk_problems(sdk, good) == []
    mutations = {
        "misspelt panel key": lambda b: b["panels"][0].update(gridPoss=b["panels"][0].pop("gridPos")),
        "string gridPos.h": lambda b: b["panels"][0]["gridPos"].update(h="9"),
        "unknown panel option": lambda b: b["panels"][0]["options"].update(legendd={}),
        "unknown legend option": lambda b: b["panels"][0]["options"]["legend"].update(position="bottom"),
        "legend displayMode not in its enum": lambda b: b["panels"][0]["options"]["legend"].update(
            displayMode="grid"),
        "unknown custom field config": lambda b: b["panels"][0]["fieldConfig"]["defaults"]["custom"].update(
            lineWidht=2),
        "custom drawStyle not in its enum": lambda b: b["panels"][0]["fieldConfig"]["defaults"]["custom"].update(
            drawStyle="curve"),
        "boolean as string": lambda b: b.update(editable="false"),
        "graphTooltip out of range": lambda b: b.update(graphTooltip=3),
        "unknown dashboard key": lambda b: b.update(colour="blue"),
        "unknown variable key": lambda b: b["templating"]["list"][0].update(definition="SELECT 1"),
        "variable refresh out of range": lambda b: b["templating"]["list"][0].update(refresh=5),
        "unknown timepicker key": lambda b: b["timepicker"].update(time_options=[]),
        "unknown transformation key": lambda b: b["panels"][0].update(
            transformations=[{"id": "organize", "options": {}, "disable": True}]),
        "unknown panel type": lambda b: b["panels"][0].update(type="graph"),
        "custom field config on a panel without one": lambda b: b["panels"].append(stat_with_custom()),
        "unknown annotation key": lambda b: b["annotations"]["list"][0].update(colour="red"),
    }
    for what, mutate in mutations.items():
        board = json.loads(json.dumps(good))
        mutate(board)
        assert sdk_problems(sdk, board), f"{what} went unnoticed"


# ---- Grafana 11.6's schema as @grafana/schema types it (tsc --strict) ---------------------------

SCHEMA_DIR = REPO / ".cache" / "grafana-schema"  # scripts/ensure-grafana-schema.sh installs it

TS_PRELUDE = """\
import type {{ Dashboard, DataQuery, DataSourceRef, Panel }} from '@grafana/schema';
{imports}

// JSON spells an enum member by its value: a string enum of the schema becomes the union of its values.
type Json<T> = T extends string ? `${{T}}`
  : T extends readonly (infer U)[] ? Json<U>[]
  : T extends object ? {{ [K in keyof T]: Json<T[K]> }}
  : T;

// NOT from the schema: the query of Grafana's PostgreSQL datasource, which @grafana/schema does not
// type (Panel.targets is Array<Record<string, unknown>> there). Only its base, DataQuery, is the schema's.
interface SQLQuery extends DataQuery {{
  datasource: DataSourceRef;
  editorMode: 'code' | 'builder';
  format: 'table' | 'time_series';
  rawQuery: true;
  rawSql: string;
}}

// A panel type whose schema has no Options or FieldConfig has none: any key there is unknown.
type None = Record<string, never>;

"""


def panel_schema_modules() -> dict[str, tuple[str, set[str]]]:
    """{panel type: (import path, {"Options", "FieldConfig"} it exports)} of @grafana/schema's panel schemas."""
    out = {}
    root = SCHEMA_DIR / "node_modules" / "@grafana" / "schema"
    for path in sorted((root / "dist" / "esm" / "raw" / "composable").glob("*/panelcfg/x/*PanelCfg_types.gen.d.ts")):
        exports = set(re.findall(r"^export interface (Options|FieldConfig)\b", path.read_text(), re.M))
        module = "@grafana/schema/" + str(path.relative_to(root)).removesuffix(".d.ts")
        out[path.parts[-4]] = (module, exports)
    return out


def to_ts(board: dict, const: str, modules: dict[str, tuple[str, set[str]]]) -> tuple[str, set[str]]:
    """`board` as the TypeScript `const <const>: Json<Dashboard> = {...}`, every panel, its options,
    custom field config and queries `satisfies` their types; returns the source and the panel types used."""
    lit = json.dumps
    used: set[str] = set()

    def alias(kind: str) -> str:
        return "p_" + re.sub(r"\W", "_", kind)

    def panel(p: dict) -> str:
        kind = p.get("type", "")
        key = kind.replace("-", "")
        if key not in modules:  # not a panel of the schema: leave it to Json<Panel> (type: string)
            return lit(p)
        used.add(key)
        _, exports = modules[key]
        schema = {name: f"Json<{alias(key)}.{name}>" if name in exports else "None"
                  for name in ("Options", "FieldConfig")}
        fields = []
        for k, v in p.items():
            if k == "options":
                value = f"{lit(v)} satisfies {schema['Options']}"
            elif k == "fieldConfig" and isinstance(v, dict) and isinstance(v.get("defaults"), dict):
                defaults = ", ".join(f"{lit(dk)}: {lit(dv)}" + (f" satisfies {schema['FieldConfig']}" if dk == "custom"
                                                               else "") for dk, dv in v["defaults"].items())
                value = "{" + ", ".join([f'"defaults": {{{defaults}}}'] +
                                        [f"{lit(fk)}: {lit(fv)}" for fk, fv in v.items() if fk != "defaults"]) + "}"
            elif k == "targets" and isinstance(v, list):
                value = "[" + ", ".join(f"{lit(t)} satisfies SQLQuery" for t in v) + "]"
            else:
                value = lit(v)
            fields.append(f"    {lit(k)}: {value}")
        return "{\n" + ",\n".join(fields) + "\n  } satisfies Json<Panel>"

    queries: list[str] = []

    def annotation(a: dict) -> str:
        # Declared apart, so that the SQL keys are checked against SQLQuery and the annotation's
        # target (a DataQuery in @grafana/schema) gets no excess-property check for them.
        fields = []
        for k, v in a.items():
            if k == "target":
                queries.append(f"const {const}_query{len(queries)} = {lit(v)} satisfies SQLQuery;\n")
                fields.append(f"{lit(k)}: {const}_query{len(queries) - 1}")
            else:
                fields.append(f"{lit(k)}: {lit(v)}")
        return "{" + ", ".join(fields) + "}"

    fields = []
    for k, v in board.items():
        if k == "panels" and isinstance(v, list):
            value = "[\n  " + ",\n  ".join(panel(p) for p in v) + "\n]"
        elif k == "annotations" and isinstance(v, dict) and isinstance(v.get("list"), list):
            value = "{" + ", ".join([f'"list": [{", ".join(annotation(a) for a in v["list"])}]'] +
                                    [f"{lit(ak)}: {lit(av)}" for ak, av in v.items() if ak != "list"]) + "}"
        else:
            value = lit(v)
        fields.append(f"  {lit(k)}: {value}")
    body = f"export const {const}: Json<Dashboard> = {{\n" + ",\n".join(fields) + "\n};\n"
    return "".join(queries) + body, used


def typecheck(boards: dict[str, dict], workdir: Path) -> dict[str, list[str]]:
    """{file name: tsc's errors} for every board, compiled together in one `tsc --strict` run."""
    schema = SCHEMA_DIR / "node_modules" / "@grafana" / "schema" / "package.json"
    tsc = SCHEMA_DIR / "node_modules" / "typescript" / "bin" / "tsc"
    require(shutil.which("node") is not None and schema.exists() and tsc.exists(),
            "@grafana/schema or typescript is missing: run bash scripts/ensure-grafana-schema.sh")
    version = json.loads(schema.read_text())["version"]
    assert version == GEN.GRAFANA_VERSION, f"@grafana/schema {version} is not for Grafana {GEN.GRAFANA_VERSION}: " \
        "update scripts/ensure-grafana-schema.sh"
    modules = panel_schema_modules()
    files = {}
    for i, (name, board) in enumerate(sorted(boards.items())):
        body, used = to_ts(board, f"dashboard{i}", modules)
        imports = "\n".join(f"import type * as p_{key} from '{modules[key][0]}';" for key in sorted(used))
        (workdir / f"{Path(name).stem}.ts").write_text(TS_PRELUDE.format(imports=imports) + body)
        files[f"{Path(name).stem}.ts"] = name
    package = str(SCHEMA_DIR / "node_modules" / "@grafana" / "schema")
    (workdir / "tsconfig.json").write_text(json.dumps({
        "compilerOptions": {"strict": True, "noEmit": True, "target": "es2022", "module": "commonjs",
                            "moduleResolution": "node10", "skipLibCheck": True, "types": [],
                            "paths": {"@grafana/schema": [package], "@grafana/schema/*": [package + "/*"]}},
        "files": sorted(files)}))
    result = subprocess.run(["node", str(tsc), "-p", str(workdir / "tsconfig.json"), "--pretty", "false"],
                            cwd=workdir, capture_output=True, text=True, timeout=300)
    errors: dict[str, list[str]] = {name: [] for name in [*boards, "?"]}
    where = "?"
    for line in result.stdout.splitlines():
        match = re.match(r"(\S+?\.ts)\(", line)
        if match or not line.startswith(" "):  # an indented line goes on with the error before it
            where = files.get(Path(match[1]).name, "?") if match else "?"
        errors[where].append(line)
    assert result.returncode == 0 or any(errors.values()), result.stdout + result.stderr
    return errors


@pytest.fixture(scope="module")
def tsc_errors(tmp_path_factory) -> dict[str, list[str]]:
    return typecheck(committed(), tmp_path_factory.mktemp("grafana-schema-ts"))


@pytest.mark.parametrize("name", sorted(GEN.dashboards()))
def test_dashboard_typechecks_against_grafana_schema(name, tsc_errors):
    """The dashboard as a TypeScript literal of @grafana/schema's Dashboard type compiles with
    tsc --strict: no unknown key anywhere in a typed place (excess-property checks), every
    required key present, every value of its type or enum."""
    assert tsc_errors[name] == [] and tsc_errors.get("?", []) == []


def test_the_typescript_check_catches_what_the_schema_refuses(tmp_path):
    good = GEN.dashboards()["latency.json"]
    mutations = {
        "misspelt panel key": lambda b: b["panels"][0].update(gridPoss=b["panels"][0].pop("gridPos")),
        "string gridPos.h": lambda b: b["panels"][0]["gridPos"].update(h="9"),
        "missing gridPos.w": lambda b: b["panels"][0]["gridPos"].pop("w"),
        "unknown panel option": lambda b: b["panels"][0]["options"].update(legendd={}),
        "legend displayMode not in its enum": lambda b: b["panels"][0]["options"]["legend"].update(
            displayMode="grid"),
        "unknown custom field config": lambda b: b["panels"][0]["fieldConfig"]["defaults"]["custom"].update(
            lineWidht=2),
        "unknown field config key": lambda b: b["panels"][0]["fieldConfig"]["defaults"].update(units="ms"),
        "boolean as string": lambda b: b.update(editable="false"),
        "graphTooltip out of range": lambda b: b.update(graphTooltip=3),
        "unknown dashboard key": lambda b: b.update(colour="blue"),
        "unknown variable key": lambda b: b["templating"]["list"][0].update(definition="SELECT 1"),
        "unknown timepicker key": lambda b: b["timepicker"].update(time_options=[]),
        "unknown annotation key": lambda b: b["annotations"]["list"][0].update(colour="red"),
        "query without refId": lambda b: b["panels"][0]["targets"][0].pop("refId"),
        "misspelt query key": lambda b: b["panels"][0]["targets"][0].update(rawSQL="SELECT 1"),
        "annotation query without rawSql": lambda b: b["annotations"]["list"][0]["target"].pop("rawSql"),
        "custom field config on a panel without one": lambda b: b["panels"].append(stat_with_custom()),
    }
    boards = {"good.json": good}
    for i, mutate in enumerate(mutations.values()):
        board = json.loads(json.dumps(good))
        mutate(board)
        boards[f"mutation{i}.json"] = board
    errors = typecheck(boards, tmp_path)
    assert errors["good.json"] == [] and errors.get("?", []) == [], errors
    for i, what in enumerate(mutations):
        assert errors[f"mutation{i}.json"], f"{what} went unnoticed"


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
    from orchestrator.store.models import (
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
                job = Job(kind=JobKind.latency, spec={"model": "tiny", "height": 64, "width": 64, "steps": 2,
                                                      "precision": "fp32", "profile": "auto"},
                          device_id=device.id, build_id=build.id)
                s.add(job)
                s.flush()
                environment = {"os": "Android", "os_version": "14", "driver": f"512.{i}"}  # a driver update
                run = Run(job_id=job.id, attempt=1, device_id=device.id, build_id=build.id, status=RunStatus.succeeded,
                          engine={}, artifacts=[], cooldown_wait_s=12.5, cooldown_timed_out=i == 1,
                          started_at=build.created, finished_at=build.created + dt.timedelta(minutes=5),
                          environment=environment, env_key=f"env{i:013d}")
                s.add(run)
                s.flush()
                s.add_all([Sample(run_id=run.id, metric="unet_step_ms", unit="ms", value=100.0 + 10 * i + r,
                                  repetition=r) for r in range(5)])
                s.add(Sample(run_id=run.id, metric="peak_gpu_bytes", unit="bytes", value=2.0e9, repetition=0))
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
            if v["type"] == "textbox":  # what a person types: no query
                variables[v["name"]] = [v["query"]]
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
        conn.execute(text(interpolate(sql, {"device": ["1"], "metric": ["unet_step_ms"], "kind": ["latency"],
                                            "model": ["tiny"], "resolution": ["64x64"], "steps": ["2"],
                                            "precision": ["fp32"], "profile": ["auto"]}, board)))


def test_latency_band_overrides_name_real_columns():
    board = GEN.latency_dashboard()
    sql = board["panels"][0]["targets"][0]["rawSql"]
    for override in board["panels"][0]["fieldConfig"]["overrides"]:
        assert f'AS "{override["matcher"]["options"]}"' in sql
        for prop in override["properties"]:
            if prop["id"] == "custom.fillBelowTo":
                assert f'AS "{prop["value"]}"' in sql


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_the_latency_dashboards_series_variables_key_runs_as_the_analysis_does(db_engine, Session):  # noqa: N803
    """The SQL of each part of the series key (model, resolution, steps, precision, profile) gives,
    for a job's spec, exactly what the analysis' SpecKey.of gives, defaults and all."""
    from orchestrator.analysis.regressions import SpecKey
    from orchestrator.store.models import Device, Job, JobKind

    seed(Session)
    specs = [{"model": "sd14", "height": 512, "width": 768, "steps": 20, "precision": "fp16", "profile": "adreno"},
             {"model": "tiny"},  # every default
             {"model": "tiny", "height": 64, "width": None, "steps": 4},  # no width: native
             {"model": "tiny", "height": 0, "width": 64, "precision": "f16s", "profile": "auto"}]
    with Session() as s, s.begin():
        device = s.query(Device).first()
        jobs = [Job(kind=JobKind.latency, spec=spec, device_id=device.id) for spec in specs]
        s.add_all(jobs)
        s.flush()
        ids = [j.id for j in jobs]
    columns = ", ".join(f'{sql} AS "{name}"' for name, sql in GEN.SPEC_COLUMNS.items())
    with db_engine.connect() as conn:
        for job_id, spec in zip(ids, specs, strict=True):
            row = conn.execute(text(f"SELECT {columns} FROM jobs j WHERE j.id = :id"), {"id": job_id}).one()
            key = SpecKey.of(spec)
            assert dict(row._mapping) == {"model": key.model, "resolution": key.resolution, "steps": str(key.steps),
                                          "precision": key.precision, "profile": key.profile}, spec
