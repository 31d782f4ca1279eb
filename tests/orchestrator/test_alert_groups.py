"""Alert groups (issue 41): one slow build raised one alert per device and metric, ten for five
devices and two metrics, each triaged alone. Now every alert of a build pair joins one group,
made with the pair's first alert, which people list (devices x metrics, worst change, counts by
state), triage in bulk and give an owner, a bug link and a note, in the store (SQLite and
PostgreSQL), the API (TestClient, each scope) and the CLI; alerts carry their series and group;
`farm regressions show` prints numbers people read.

The store is seeded the farm's way: devices p1-p3, builds b1 and b2 at 100 ms a UNet step and
2,000 ms end to end, b3 30 % slower on both, b3's batch analysed for real."""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import threading
import uuid

import numpy as np
import pytest
from alembic import command
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url
from support import seed_nightlies
from typer.testing import CliRunner

from agent.protocol import JobResult, Sample
from orchestrator import store
from orchestrator.analysis import series as farm_series
from orchestrator.api import tokens
from orchestrator.api.app import create_app
from orchestrator.infra.settings import Settings
from orchestrator.jobs import batch_analysis
from orchestrator.store import migrate, upgrade
from orchestrator.store.models import Alert, AlertGroup, AlertKind, AlertState

SPEC = {"model": "models/tiny", "precision": "fp32", "steps": 2, "prompt": "a red bicycle", "seed": 0}
SERIALS = ("p1", "p2", "p3")
METRICS = ("e2e_ms", "unet_step_ms")


def _latency(rng, slow: float) -> JobResult:
    steps = 100.0 * slow * rng.lognormal(0.0, 0.02, 10)
    e2e = 2000.0 * slow * rng.lognormal(0.0, 0.02, 10)
    return JobResult(job_id="j", kind="latency", status="succeeded",
                     samples=[Sample("unet_step_ms", float(v), "ms", r) for r, v in enumerate(steps)]
                     + [Sample("e2e_ms", float(v), "ms", r) for r, v in enumerate(e2e)])


def _seed(sessions) -> None:
    rng = np.random.default_rng(20261206)
    with sessions() as s, s.begin():
        devices = [store.upsert_device(s, serial, "local", f"/tmp/{serial}", host="h") for serial in SERIALS]
        for device in devices:
            store.set_device_state(s, device.id, "available")
        batches = seed_nightlies(s, devices, SPEC, lambda slow: _latency(rng, slow))
    batch_analysis.analyze_in_store(sessions, batches["b3"])


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def seeded(request, tmp_path_factory):
    """The seeded, analysed store, made once a module for each backend: each test gets a copy
    (a file copy, or a database made from it as a template)."""
    root = tmp_path_factory.mktemp("seeded")
    if request.param == "sqlite":
        url = f"sqlite:///{root / 'farm.db'}"
    else:
        server = make_url(request.getfixturevalue("pg_server_url"))
        admin = create_engine(server, isolation_level="AUTOCOMMIT")
        template = f"farm_groups_{uuid.uuid4().hex[:12]}"
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{template}"'))
        url = server.set(database=template).render_as_string(hide_password=False)
    store.upgrade(url)
    engine = store.make_engine(url)
    _seed(store.make_session_factory(engine))
    engine.dispose()
    if request.param == "sqlite":
        yield lambda tmp_path: shutil.copy(root / "farm.db", tmp_path / "farm.db") and f"sqlite:///{tmp_path}/farm.db"
        return
    copies: list[str] = []

    def copy(_tmp_path) -> str:
        copies.append(f"farm_groups_{uuid.uuid4().hex[:12]}")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{copies[-1]}" TEMPLATE "{template}"'))
        return server.set(database=copies[-1]).render_as_string(hide_password=False)

    yield copy
    with admin.connect() as conn:
        for name in [*copies, template]:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def farm(seeded, tmp_path):
    """A copy of the seeded store, its settings, a read and a triage token."""
    url = seeded(tmp_path)
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name="h", database_url=url)
    engine = store.make_engine(url)
    sessions = store.make_session_factory(engine)
    with sessions() as s, s.begin():
        made = {scope: tokens.create_token(s, scope, f"{scope} token")[1] for scope in ("read", "triage")}
    yield {"settings": settings, "sessions": sessions, "tokens": made, "url": url}
    engine.dispose()


def _regressions(sessions) -> list[Alert]:
    with sessions() as s:
        return list(s.scalars(select(Alert).where(Alert.kind == AlertKind.regression).order_by(Alert.id)))


# ---- the store ----------------------------------------------------------------------------


def test_one_slow_build_is_one_group_of_its_device_by_metric_alerts(farm):
    alerts = _regressions(farm["sessions"])
    assert {(a.device_id, a.metric) for a in alerts} and len(alerts) == len(SERIALS) * len(METRICS)
    assert len({a.group_id for a in alerts}) == 1 and alerts[0].group_id is not None
    with farm["sessions"]() as s:
        (view,) = store.list_alert_groups(s)
        assert (view.group.build.name, view.group.baseline_build.name) == ("b3", "b2")
        assert view.devices == list(SERIALS) and view.metrics == list(METRICS)
        assert view.kinds == {"regression": 6} and view.states == {"new": 6, "acknowledged": 0, "invalid": 0,
                                                                    "fixed": 0}
        assert view.open and view.worst.ratio == max(a.ratio for a in alerts) and 1.2 < view.worst.ratio < 1.4


def test_a_group_is_triaged_in_bulk_or_by_the_alerts_chosen(farm):
    alerts = _regressions(farm["sessions"])
    group_id = alerts[0].group_id
    with farm["sessions"]() as s, s.begin():
        view = store.triage_group(s, group_id, AlertState.acknowledged, "on it")
        assert view.states["acknowledged"] == 6
    with farm["sessions"]() as s, s.begin():
        store.triage_group(s, group_id, "fixed", alert_ids=[alerts[0].id, alerts[1].id])
    with farm["sessions"]() as s:
        states = {a.id: (a.state, a.note) for a in s.scalars(select(Alert).where(Alert.group_id == group_id))}
    assert states[alerts[0].id] == states[alerts[1].id] == (AlertState.fixed, "on it")
    assert {states[a.id] for a in alerts[2:]} == {(AlertState.acknowledged, "on it")}
    with farm["sessions"]() as s, pytest.raises(store.StoreError, match=r"alert 999999 not in group .*group show"):
        store.triage_group(s, group_id, "fixed", alert_ids=[alerts[0].id, 999999])
    with farm["sessions"]() as s, pytest.raises(store.StoreError, match="no alert group 999999"):
        store.triage_group(s, 999999, "fixed")
    with farm["sessions"]() as s:  # every alert closed: no open group left, but --all lists it
        store.triage_group(s, group_id, "invalid")
        assert store.list_alert_groups(s) == []
        assert [v.group.id for v in store.list_alert_groups(s, states=tuple(AlertState))] == [group_id]


def test_a_bulk_triage_changes_only_the_groups_open_alerts(farm):
    """A group of 6, one invalid and one fixed: Acknowledge with no alert named changes the 4
    open ones and leaves the closed ones as they are (an invalid alert's build stays a
    baseline); named, a closed one changes too. With nothing open, the bulk action says so."""
    alerts = _regressions(farm["sessions"])
    group_id, invalid, fixed, rest = alerts[0].group_id, alerts[0].id, alerts[1].id, [a.id for a in alerts[2:]]
    with farm["sessions"]() as s, s.begin():
        store.triage_group(s, group_id, AlertState.invalid, "noise", alert_ids=[invalid])
        store.triage_group(s, group_id, AlertState.fixed, alert_ids=[fixed])
        store.triage_group(s, group_id, AlertState.acknowledged, alert_ids=rest[:1])  # open, acknowledged already
    with farm["sessions"]() as s, s.begin():
        view = store.triage_group(s, group_id, AlertState.acknowledged, "on it")
        assert view.states == {"new": 0, "acknowledged": 4, "invalid": 1, "fixed": 1}
        assert sorted(view.triaged) == rest
    with farm["sessions"]() as s:
        states = {a.id: (a.state, a.note) for a in s.scalars(select(Alert).where(Alert.group_id == group_id))}
    assert states[invalid] == (AlertState.invalid, "noise") and states[fixed] == (AlertState.fixed, "")
    assert {states[a] for a in rest} == {(AlertState.acknowledged, "on it")}
    with farm["sessions"]() as s, s.begin():  # named, a closed alert is reopened
        view = store.triage_group(s, group_id, AlertState.acknowledged, alert_ids=[invalid])
        assert view.triaged == (invalid,) and view.states["invalid"] == 0
    with farm["sessions"]() as s, s.begin():
        store.triage_group(s, group_id, AlertState.fixed)
    with farm["sessions"]() as s, pytest.raises(
            store.InvalidTransition, match=rf"^group {group_id} has no open alert \(6 fixed\): name the ones to "
                                           rf"change with --only ID \(API: alert_ids\); `farm regressions group show "
                                           rf"{group_id}` lists them$"):
        store.triage_group(s, group_id, AlertState.invalid)


def test_a_group_takes_an_owner_an_http_bug_link_and_a_note(farm):
    group_id = _regressions(farm["sessions"])[0].group_id
    with farm["sessions"]() as s, s.begin():
        store.update_alert_group(s, group_id, owner="ana", bug_url="https://bugs.example.com/41", note="attention")
    for bad in ("javascript:alert(1)", "ftp://bugs.example.com/1", "bugs.example.com/1", "https://", "http://a b"):
        with farm["sessions"]() as s, pytest.raises(store.StoreError, match="is not an http\\(s\\) URL"):
            store.update_alert_group(s, group_id, bug_url=bad)
    with farm["sessions"]() as s:
        (view,) = store.list_alert_groups(s, owner="ana")
        assert (view.group.owner, view.group.bug_url, view.group.note) == ("ana", "https://bugs.example.com/41",
                                                                           "attention")
        assert store.list_alert_groups(s, owner="") == []
        store.update_alert_group(s, group_id, bug_url="")  # "" clears it
        assert store.get_alert_group(s, group_id).group.bug_url == ""


def test_alerts_raised_before_groups_are_grouped_by_the_migration(farm):
    """A store whose alerts were raised before groups existed: upgrading to 0025 puts each in
    its build pair's group; a data stoppage, a device's with no build, stays alone."""
    with farm["sessions"]() as s, s.begin():
        device = store.get_device(s, "p1")
        s.add(Alert(kind=AlertKind.data_stoppage, device_id=device.id, metric="", series={"device": "p1"},
                    summary="p1 has not reported", detail={}))
    command.downgrade(migrate.alembic_config(farm["url"]), "0024")
    upgrade(farm["url"])
    with farm["sessions"]() as s:
        (view,) = store.list_alert_groups(s, states=tuple(AlertState))
        assert len(view.alerts) == 6 and view.devices == list(SERIALS)
    with farm["sessions"]() as s:
        stoppage = s.scalar(select(Alert).where(Alert.kind == AlertKind.data_stoppage))
        assert stoppage.group_id is None
        assert s.scalar(select(Alert.id).where(Alert.kind == AlertKind.regression, Alert.group_id.is_(None))) is None


def test_filters_and_sorts_over_several_groups(farm):
    """A second pair (b2 against b1, made by hand) is a group of its own: filters by build,
    device, metric and kind find one or the other; sort by worst change and by size."""
    with farm["sessions"]() as s, s.begin():
        b1, b2 = store.get_build(s, "b1"), store.get_build(s, "b2")
        p2 = store.get_device(s, "p2")
        small = store.save_alert(s, Alert(kind=AlertKind.improvement, build_id=b2.id, baseline_build_id=b1.id,
                                          device_id=p2.id, metric="unet_step_ms", ratio=0.5, series={},
                                          summary="faster", detail={}))
    assert small.group_id not in {a.group_id for a in _regressions(farm["sessions"])}
    with farm["sessions"]() as s:
        groups = store.list_alert_groups(s)
        assert [v.group.build.name for v in groups] == ["b2", "b3"]  # made last, listed first
        assert [v.group.build.name for v in store.list_alert_groups(s, sort="size")] == ["b3", "b2"]
        assert [v.group.build.name for v in store.list_alert_groups(s, sort="worst")] == ["b2", "b3"]  # 0.5 is 2x
        assert [v.group.build.name for v in store.list_alert_groups(s, build_id=b2.id)] == ["b2"]
        assert [v.group.build.name for v in store.list_alert_groups(s, kinds=[AlertKind.regression])] == ["b3"]
        p1 = store.get_device(s, "p1")
        assert [v.group.build.name for v in store.list_alert_groups(s, device_id=p1.id)] == ["b3"]
        assert [v.group.build.name for v in store.list_alert_groups(s, metric="e2e_ms")] == ["b3"]
        with pytest.raises(store.StoreError, match="unknown sort 'name'; choose from created, worst, size"):
            store.list_alert_groups(s, sort="name")


# ---- the API ------------------------------------------------------------------------------


def _client(farm, scope: str) -> TestClient:
    return TestClient(create_app(farm["settings"]), headers={"Authorization": f"Bearer {farm['tokens'][scope]}"})


def test_the_api_lists_groups_and_a_read_token_cannot_triage_them(farm):
    with _client(farm, "read") as read:
        (group,) = read.get("/v1/alert-groups").json()
        assert (group["build"], group["baseline_build"], group["size"]) == ("b3", "b2", 6)
        assert group["devices"] == list(SERIALS) and group["metrics"] == list(METRICS)
        assert group["states"] == {"new": 6, "acknowledged": 0, "invalid": 0, "fixed": 0} and group["open"]
        assert group["kinds"] == {"regression": 6} and 1.2 < group["worst_ratio"] < 1.4
        assert read.get("/v1/alert-groups", params={"device": "p9"}).status_code == 404
        assert read.get("/v1/alert-groups", params={"metric": "e2e_ms", "sort": "worst"}).json()[0]["id"] == \
            group["id"]
        assert read.get("/v1/alert-groups", params={"owner": "ana"}).json() == []
        assert read.get("/v1/alert-groups", params={"sort": "name"}).status_code == 422
        detail = read.get(f"/v1/alert-groups/{group['id']}").json()
        assert [a["id"] for a in detail["full_alerts"]] == [a["id"] for a in group["alerts"]]
        assert read.get("/v1/alert-groups/999999").status_code == 404
        for action in ("acknowledge", "invalidate", "fixed"):
            refused = read.post(f"/v1/alert-groups/{group['id']}/{action}", json={})
            assert refused.status_code == 403 and "does not grant triage" in refused.json()["detail"]
        assert read.patch(f"/v1/alert-groups/{group['id']}", json={"owner": "me"}).status_code == 403
    with farm["sessions"]() as s:
        assert {a.state for a in s.scalars(select(Alert))} == {AlertState.new}


def test_alerts_carry_their_series_and_group(farm):
    """A regression names its latency series and its group; a fidelity alert (an image, no
    chart) only its group; a data stoppage neither."""
    with farm["sessions"]() as s, s.begin():
        b2, b3, p1 = store.get_build(s, "b2"), store.get_build(s, "b3"), store.get_device(s, "p1")
        key = s.scalar(select(Alert.series).where(Alert.kind == AlertKind.regression).limit(1))
        image = store.save_alert(s, Alert(kind=AlertKind.fidelity, build_id=b3.id, baseline_build_id=b2.id,
                                          device_id=p1.id, metric="image_psnr_db", summary="image", detail={},
                                          series=key | {"metric": "image_psnr_db", "prompt": "a cat", "seed": 0}))
        quiet = store.save_alert(s, Alert(kind=AlertKind.data_stoppage, device_id=p1.id, metric="",
                                          series={"device": "p1"}, summary="quiet", detail={}))
        ids = {"fidelity": image.id, "stoppage": quiet.id}
    with _client(farm, "read") as read:
        everything = read.get("/v1/alerts").json()
        others = {a["id"]: (a["series_id"], a["group_id"]) for a in everything if a["kind"] != "regression"}
        alerts = [a for a in everything if a["kind"] == "regression"]
        assert len(alerts) == 6
        assert others == {ids["fidelity"]: (None, alerts[0]["group_id"]), ids["stoppage"]: (None, None)}
        for alert in alerts:
            series = read.get(f"/v1/series/{alert['series_id']}")
            assert series.status_code == 200, alert
            assert (series.json()["key"]["device"], series.json()["key"]["metric"]) == (alert["device"],
                                                                                        alert["metric"])
        assert len({a["group_id"] for a in alerts}) == 1
        assert read.get(f"/v1/alerts/{alerts[0]['id']}").json()["group_id"] == alerts[0]["group_id"]


def test_a_triage_token_triages_a_group_in_bulk_and_assigns_it(farm):
    with _client(farm, "triage") as triage:
        (group,) = triage.get("/v1/alert-groups").json()
        first = [a["id"] for a in group["alerts"][:2]]
        done = triage.post(f"/v1/alert-groups/{group['id']}/acknowledge", json={"note": "on it"}).json()
        assert done["states"]["acknowledged"] == 6 and {a["note"] for a in done["full_alerts"]} == {"on it"}
        done = triage.post(f"/v1/alert-groups/{group['id']}/fixed", json={"alert_ids": first}).json()
        assert done["states"] == {"new": 0, "acknowledged": 4, "invalid": 0, "fixed": 2}
        stranger = triage.post(f"/v1/alert-groups/{group['id']}/fixed", json={"alert_ids": [999999]})
        assert stranger.status_code == 404 and "not in group" in stranger.json()["detail"]
        bad = triage.patch(f"/v1/alert-groups/{group['id']}", json={"bug_url": "javascript:alert(1)"})
        assert bad.status_code == 422 and "is not an http(s) URL" in json.dumps(bad.json())
        set_ = triage.patch(f"/v1/alert-groups/{group['id']}", json={"owner": "ana", "bug_url": "https://b.example/7"})
        assert (set_.json()["owner"], set_.json()["bug_url"], set_.json()["note"]) == ("ana", "https://b.example/7", "")
        assert [g["id"] for g in triage.get("/v1/alert-groups", params={"owner": "ana"}).json()] == [group["id"]]
        triage.post(f"/v1/alert-groups/{group['id']}/invalidate")
        assert triage.get("/v1/alert-groups").json() == []
        assert triage.get("/v1/alert-groups", params={"state": "invalid"}).json()[0]["size"] == 6
    with farm["sessions"]() as s:  # the bulk invalidate left the 2 fixed ones fixed
        assert sorted(str(a.state) for a in s.scalars(select(Alert))) == ["fixed"] * 2 + ["invalid"] * 4


def test_the_api_and_the_cli_leave_a_groups_closed_alerts_to_a_bulk_triage(farm, farm_cli):
    """POST /v1/alert-groups/{id}/acknowledge with {} (the dashboard's button) and `farm
    regressions ack --group` change the open alerts only, and answer 409 / exit 3 when none is."""
    alerts = _regressions(farm["sessions"])
    group_id, invalid = alerts[0].group_id, alerts[0].id
    with _client(farm, "triage") as triage:
        triage.post(f"/v1/alert-groups/{group_id}/invalidate", json={"alert_ids": [invalid]})
        done = triage.post(f"/v1/alert-groups/{group_id}/acknowledge", json={}).json()
        assert done["states"] == {"new": 0, "acknowledged": 5, "invalid": 1, "fixed": 0}
        assert f"group {group_id}: 5 alerts fixed (1 invalid, 5 fixed)" in farm_cli(
            "regressions", "fixed", "--group", str(group_id))
        refused = triage.post(f"/v1/alert-groups/{group_id}/acknowledge", json={})
        assert refused.status_code == 409 and f"group {group_id} has no open alert (1 invalid, 5 fixed)" in \
            refused.json()["detail"]
        out = farm_cli("regressions", "ack", "--group", str(group_id), code=3)
        assert "has no open alert" in out and "Traceback" not in out
        again = triage.post(f"/v1/alert-groups/{group_id}/acknowledge", json={"alert_ids": [invalid]}).json()
        assert again["states"] == {"new": 0, "acknowledged": 1, "invalid": 0, "fixed": 5}


def test_the_api_filters_a_data_stoppage_older_than_the_newest_50_alerts(farm):
    """The overview asks /v1/alerts for kind=data_stoppage (with its state and limit=500), and
    /v1/alert-groups with limit=500: 60 regressions newer than a stoppage crowd it out of the
    unfiltered list (the newest 50), not out of the filtered one."""
    with farm["sessions"]() as s, s.begin():
        b1, b3, p1 = store.get_build(s, "b1"), store.get_build(s, "b3"), store.get_device(s, "p1")
        quiet = store.save_alert(s, Alert(kind=AlertKind.data_stoppage, device_id=p1.id, metric="",
                                          series={"device": "p1"}, summary="p1 has not reported", detail={},
                                          created_at=store.utcnow() - dt.timedelta(hours=1))).id
        for i in range(60):
            store.save_alert(s, Alert(kind=AlertKind.regression, build_id=b3.id, baseline_build_id=b1.id,
                                      device_id=p1.id, metric=f"m{i}_ms", ratio=1.3, series={}, summary="slower",
                                      detail={}))
    with _client(farm, "read") as read:
        assert quiet not in [a["id"] for a in read.get("/v1/alerts").json()]
        open_ = {"kind": "data_stoppage", "limit": 500}
        assert [a["id"] for a in read.get("/v1/alerts", params=open_).json()] == [quiet]
        every = read.get("/v1/alerts", params=open_ | {"state": ["new", "acknowledged", "invalid", "fixed"]})
        assert [a["id"] for a in every.json()] == [quiet]
        assert read.get("/v1/alerts", params=open_ | {"state": "fixed"}).json() == []
        groups = read.get("/v1/alert-groups", params={"limit": 500}).json()
        assert sorted(g["size"] for g in groups) == [6, 60]


# ---- the CLI ------------------------------------------------------------------------------


@pytest.fixture
def farm_cli(farm, monkeypatch):
    """`farm_cli(*args, code=0)`: `farm` on the farm's copy, its output on one wide line."""
    from orchestrator.cli import app

    monkeypatch.setenv("FARM_DATABASE_URL", farm["url"])
    monkeypatch.setenv("FARM_DATA_DIR", str(farm["settings"].data_dir))
    monkeypatch.setenv("FARM_CONFIG_DIR", str(farm["settings"].config_dir))
    monkeypatch.setenv("COLUMNS", "240")
    monkeypatch.delenv("FARM_BROKER_URL", raising=False)
    runner = CliRunner()

    def invoke(*args: str, code: int = 0) -> str:
        result = runner.invoke(app, list(args))
        assert result.exit_code == code, result.output
        return result.output

    return invoke


def _group_id(farm) -> int:
    return _regressions(farm["sessions"])[0].group_id


def test_farm_regressions_list_shows_one_line_per_group(farm, farm_cli):
    group_id = _group_id(farm)
    out = farm_cli("regressions", "list")
    (row,) = [line for line in out.splitlines() if line.split("\t")[0] == str(group_id)]  # piped: tab-separated
    worst = max(a.ratio for a in _regressions(farm["sessions"]))
    assert "b2 -> b3" in row and "3 x 2" in row and f"+{(worst - 1) * 100:.1f}%" in row and "6 new" in row, out
    listed = json.loads(farm_cli("regressions", "list", "--json"))
    assert [(g["id"], g["size"], g["devices"], g["metrics"]) for g in listed] == [
        (group_id, 6, list(SERIALS), list(METRICS))]
    flat = json.loads(farm_cli("regressions", "list", "--alerts", "--json"))
    assert len(flat) == 6 and {a["group"] for a in flat} == {group_id}
    with farm["sessions"]() as s:
        series = {(x.key.device, x.key.metric): x.id for x in farm_series.list_series(s)}
    assert {a["series_id"] for a in flat} == {series[(a["device"], a["metric"])] for a in flat}
    assert json.loads(farm_cli("regressions", "list", "--device", "p2", "--metric", "e2e_ms", "--sort", "worst",
                               "--json"))[0]["id"] == group_id
    assert "unknown sort 'name'; choose from created, worst, size" in farm_cli("regressions", "list", "--sort", "name",
                                                                              code=3)


def test_farm_regressions_ack_a_group_then_assign_it(farm, farm_cli):
    group_id = _group_id(farm)
    chosen = [a.id for a in _regressions(farm["sessions"])[:2]]
    assert f"group {group_id}: 6 alerts acknowledged (6 acknowledged)" in farm_cli(
        "regressions", "ack", "--group", str(group_id), "--note", "on it")
    out = farm_cli("regressions", "fixed", "--group", str(group_id), "--only", str(chosen[0]), "--only", str(chosen[1]))
    assert f"group {group_id}: 2 alerts fixed (4 acknowledged, 2 fixed)" in out
    with farm["sessions"]() as s:
        assert sorted(a.id for a in s.scalars(select(Alert).where(Alert.state == AlertState.fixed))) == chosen
    assert "give an alert id or --group ID" in farm_cli("regressions", "ack", code=3)
    assert "not in group" in farm_cli("regressions", "ack", "--group", str(group_id), "--only", "999999", code=3)
    bad = farm_cli("regressions", "assign", str(group_id), "--bug", "ftp://x.example/1", code=3)
    assert "is not an http(s) URL" in bad and "Traceback" not in bad
    farm_cli("regressions", "assign", str(group_id), "--owner", "ana", "--bug", "https://bugs.example.com/41")
    row = [line for line in farm_cli("regressions", "list").splitlines() if "b2 -> b3" in line][0]
    assert "ana" in row and "https://bugs.example.com/41" in row and "4 acknowledged, 2 fixed" in row
    shown = farm_cli("regressions", "group", "show", str(group_id))
    assert f"group {group_id}: b3 against b2, 3 devices x 2 metrics" in shown and "owner: ana" in shown
    assert "no alert group 999999" in farm_cli("regressions", "group", "show", "999999", code=3)


def test_farm_regressions_show_prints_numbers_people_read(farm, farm_cli):
    """Medians in ms with a few digits, ratio 1.302, p like 1.8e-04, no -0%; and its group."""
    alert = [a for a in _regressions(farm["sessions"]) if a.metric == "unet_step_ms"][0]
    out = farm_cli("regressions", "show", str(alert.id))
    assert re.search(r"\.\d{7,}", out) is None, out  # no raw floats (161.74411000000077 before)
    assert "-0%" not in out and "-0.0%" not in out
    assert 100 <= alert.detail["baseline_median"] < 1000  # three significant digits: one decimal
    assert f"baseline_median: {alert.detail['baseline_median']:.1f} ms (n=10)" in out
    p = f"{alert.p_value:.3f}" if alert.p_value >= 0.001 else f"{alert.p_value:.1e}"
    assert f"ratio: {alert.ratio:.3f} (+{(alert.ratio - 1) * 100:.1f}%), 95% CI {alert.ci_low:.3f}-" \
           f"{alert.ci_high:.3f}, p={p}" in out
    assert f"group: {alert.group_id}: b2 -> b3, 3 devices x 2 metrics, 6 alerts (6 new)" in out


def test_two_analyses_raising_a_new_pairs_first_alerts_at_once_make_one_group(farm):
    """Two writers each raise the first alert of a new build pair (b3 against b1) at the same
    time: the second waits for the first and joins its group instead of making another."""
    def alert(s, serial: str) -> Alert:
        return Alert(kind=AlertKind.regression, build_id=store.get_build(s, "b3").id,
                     baseline_build_id=store.get_build(s, "b1").id, device_id=store.get_device(s, serial).id,
                     metric="unet_step_ms", ratio=1.3, series={}, summary="slower", detail={})

    second: dict[str, int] = {}

    def raise_second() -> None:
        with farm["sessions"]() as s, s.begin():
            second["group"] = store.save_alert(s, alert(s, "p2")).group_id

    with farm["sessions"]() as s, s.begin():
        first = store.save_alert(s, alert(s, "p1")).group_id
        writer = threading.Thread(target=raise_second)
        writer.start()
        writer.join(1.0)
        assert writer.is_alive()  # waiting for the first writer
    writer.join(20)
    assert not writer.is_alive() and second["group"] == first
    with farm["sessions"]() as s:
        assert s.scalar(select(func.count()).select_from(AlertGroup)) == 2  # b3 against b2, and b3 against b1
