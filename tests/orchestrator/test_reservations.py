"""Devices people book (`farm devices reserve`): the CLI's reserve, extend, refuse, list and
release (a reservation first, a quarantine otherwise); a schedule's firing skips a reserved
device, its batch holding no job on it and saying why (through the embedded broker, no worker);
a check that names a reserved device is refused with its holder, end and note."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from support import tiny_manifest

from orchestrator import store
from orchestrator.infra.settings import Settings
from orchestrator.jobs.batch_analysis import analyze_in_store
from orchestrator.jobs.celery_app import make_celery
from orchestrator.jobs.jobservice import fire_due_schedules, launch_suite, target_devices
from orchestrator.store import make_engine, make_session_factory, upgrade
from orchestrator.store.models import DeviceState, Job


def _add(cli, *serials: str) -> None:
    for serial in serials:
        cli("devices", "add", serial, "--transport", "adb", "--address", "127.0.0.1:5555")


def test_reserve_list_extend_refuse_and_release(cli, monkeypatch):
    _add(cli, "vphone-1", "vphone-2")
    monkeypatch.setenv("USER", "ana")
    out = cli("devices", "reserve", "vphone-1", "--for", "2h", "--note", "camera bug").output
    assert "vphone-1 is reserved by ana until" in out and "(camera bug)" in out

    held = json.loads(cli("devices", "list", "--json").output)
    assert [(d["serial"], d["reserved_by"], d["reservation_note"]) for d in held] == [
        ("vphone-1", "ana", "camera bug"), ("vphone-2", None, None)]
    until = dt.datetime.fromisoformat(held[0]["reserved_until"])
    assert dt.timedelta(minutes=119) < until - store.utcnow() <= dt.timedelta(hours=2)
    assert "ana until" in cli("devices", "list").output

    # someone else: refused in one line naming the holder, the end and the note
    refused = cli("devices", "reserve", "vphone-1", "--for", "30m", "--as", "bob", ok=False)
    assert refused.exit_code != 0
    line = refused.output.strip()
    assert "\n" not in line and line.startswith("error: vphone-1 is reserved by ana until ") and "(camera bug)" in line
    assert " UTC " in line and "ask ana" in line
    # the holder again: extended, not a second reservation
    extended = json.loads(cli("devices", "reserve", "vphone-1", "--for", "1d", "--json").output)
    assert extended["extended"] and extended["holder"] == "ana" and extended["note"] == "camera bug"
    rows = json.loads(cli("devices", "reservations", "--json").output)
    assert [(r["device"], r["holder"]) for r in rows] == [("vphone-1", "ana")]
    assert dt.datetime.fromisoformat(rows[0]["until"]) - store.utcnow() > dt.timedelta(hours=23)

    # release ends the reservation when one holds the device, and says so
    out = cli("devices", "release", "vphone-1").output
    assert "released ana's reservation of vphone-1" in out
    assert json.loads(cli("devices", "reservations", "--json").output) == []
    assert json.loads(cli("devices", "reservations", "--all", "--json").output)[0]["released_at"]
    assert "not reserved" in cli("devices", "release", "vphone-1", "--reservation", ok=False).output
    # with none, release is the quarantine's, as before
    cli("devices", "quarantine", "vphone-2", "--reason", "flaky usb")
    cli("devices", "reserve", "vphone-2", "--for", "1h", "--as", "bob")
    # both holds: which one to end is asked, not guessed (the quarantine's meaning came first)
    both = cli("devices", "release", "vphone-2", ok=False)
    assert both.exit_code == 3 and "both reserved by bob and quarantined" in both.output
    cli("devices", "release", "vphone-2", "--quarantine")
    with cli.Session() as s:
        device = store.get_device(s, "vphone-2")
        assert device.state == DeviceState.available
        assert store.active_reservation(s, device.id).holder == "bob"  # --quarantine left it


def test_a_bad_duration_is_refused_naming_the_forms(cli):
    _add(cli, "vphone-1")
    for bad in ("2x", "h", "0m", "-1h", "31d", "2 h", "1.5h", ""):
        result = cli("devices", "reserve", "vphone-1", "--for", bad, "--as", "ana", ok=False)
        assert result.exit_code != 0, bad
        assert "30m, 2h" in result.output or "at most 30 days" in result.output, result.output
    with cli.Session() as s:
        assert store.list_reservations(s) == []


def test_durations_add_up():
    from orchestrator.cli.devices import parse_duration

    assert parse_duration("30m") == dt.timedelta(minutes=30)
    assert parse_duration("2h") == dt.timedelta(hours=2)
    assert parse_duration("1d") == dt.timedelta(days=1)
    assert parse_duration("1h30m") == dt.timedelta(minutes=90)


def test_a_reservation_ends_by_itself(Session):  # noqa: N803  (both stores)
    with Session() as s, s.begin():
        device = store.upsert_device(s, "vphone-1", "adb", "127.0.0.1:5555", host="h")
        now = store.utcnow()
        store.reserve_device(s, device, "ana", now + dt.timedelta(hours=1), "x", now=now)
        assert store.active_reservation(s, device.id, now + dt.timedelta(minutes=59)) is not None
        assert store.active_reservation(s, device.id, now + dt.timedelta(minutes=61)) is None
        # once ended, another person books it
        later = now + dt.timedelta(hours=2)
        reservation, extended = store.reserve_device(s, device, "bob", later + dt.timedelta(hours=1), now=later)
        assert (reservation.holder, extended) == ("bob", False)
        with pytest.raises(store.DeviceReserved, match="vphone-1 is reserved by bob until"):
            store.reserve_device(s, device, "ana", later + dt.timedelta(hours=3), now=later)


@pytest.fixture
def farm(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name="h")
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    yield settings, make_session_factory(engine)
    engine.dispose()


def _devices_and_builds(s, serials=("vphone-1", "vphone-2"), builds=("b1",)) -> None:
    """Phones on host h and builds a day apart, in a farm's store session."""
    for serial in serials:
        store.upsert_device(s, serial, "local", "", host="h")
    for day, name in enumerate(builds):
        store.create_build(s, tiny_manifest(name, 1_700_000_000.0 + 86_400 * day))


def test_a_nightly_skips_a_reserved_device_and_its_batch_says_so(farm, caplog):
    settings, Session = farm  # noqa: N806
    now = store.utcnow()
    with Session() as s, s.begin():
        _devices_and_builds(s)
        store.reserve_device(s, store.get_device(s, "vphone-1"), "ana", now + dt.timedelta(hours=2), "camera bug")
        schedule = store.create_schedule(s, "nightly", "* * * * *", "UTC",
                                         {"jobs": [{"kind": "latency", "spec": {"model": "models/tiny"}}]})
        schedule.last_run_at = now - dt.timedelta(minutes=3)  # due
    with caplog.at_level("INFO", logger="orchestrator.jobs.jobservice"):
        [batch_id] = fire_due_schedules(make_celery(settings))
    with Session() as s:
        jobs = s.query(Job).filter(Job.batch_id == batch_id).all()
        assert {j.device.serial for j in jobs} == {"vphone-2"}  # no job on the reserved device
        batch = store.get_batch(s, batch_id)
        assert batch.summary is None  # analysed later: what `farm demo` and the tests wait on
        [skipped] = store.skipped_by_reservation(s, batch)
        assert (skipped["device"], skipped["holder"], skipped["note"]) == ("vphone-1", "ana", "camera bug")
        assert skipped["reason"].startswith("vphone-1 is reserved by ana until ")
    assert any("skips vphone-1 is reserved by ana" in r.getMessage() for r in caplog.records)
    # the batch's analysis keeps what its suite skipped
    with Session() as s, s.begin():
        for job in s.query(Job).filter(Job.batch_id == batch_id):
            store.transition_job(s, job.id, "cancelled", error="test")
    summary, _, _ = analyze_in_store(lambda: Session(), batch_id)
    assert summary["skipped"][0]["device"] == "vphone-1"
    with Session() as s, s.begin():
        assert store.get_batch(s, batch_id).summary["skipped"][0]["holder"] == "ana"
        # released since: the batch still says what it skipped when it was made
        store.release_reservation(s, store.get_device(s, "vphone-1"))
    with Session() as s:
        assert [e["device"] for e in store.skipped_by_reservation(s, store.get_batch(s, batch_id))] == ["vphone-1"]


def test_a_nightly_whose_every_device_is_reserved_launches_nothing_and_says_why(farm):
    settings, Session = farm  # noqa: N806
    now = store.utcnow()
    with Session() as s, s.begin():
        store.upsert_device(s, "vphone-1", "local", "", host="h")
        store.create_build(s, tiny_manifest("b1", 1_700_000_000.0))
        store.reserve_device(s, store.get_device(s, "vphone-1"), "ana", now + dt.timedelta(hours=2))
        schedule = store.create_schedule(s, "nightly", "* * * * *", "UTC", {"jobs": [{"kind": "latency"}]})
        schedule.last_run_at = now - dt.timedelta(minutes=3)
    app = make_celery(settings)
    assert fire_due_schedules(app) == []
    with Session() as s:
        error = store.get_schedule(s, "nightly").last_error
        assert "launched nothing" in error and "vphone-1 is reserved by ana until" in error
        assert s.query(Job).count() == 0
    # a more-repetitions round on it is refused the same way (the analysis leaves its verdict open)
    with pytest.raises(store.StoreError, match="every device it runs on is reserved: vphone-1 is reserved by ana"):
        launch_suite(app, "nightly (more repetitions, round 1)", [{"kind": "latency"}], build="b1",
                     devices=["vphone-1"], idempotency_key="more:1:1:vphone-1")
    # the holder's own suite (their `farm check`'s rounds) runs on it
    batch_id = launch_suite(app, "check b1 round 0 on vphone-1", [{"kind": "latency"}], build="b1",
                            devices=["vphone-1"], holder="ana")
    with Session() as s:
        assert [j.device.serial for j in s.query(Job).filter(Job.batch_id == batch_id)] == ["vphone-1"]
    with pytest.raises(store.StoreError, match="reserved by ana"):
        launch_suite(app, "check b1 round 0 on vphone-1", [{"kind": "latency"}], build="b1",
                     devices=["vphone-1"], holder="bob")


def test_a_check_whose_round_cannot_start_cancels_what_it_queued_and_says_why(farm, monkeypatch):
    """A check's round refused by the store (here: someone reserved the second device after the
    check began) ends the check as could-not-run (exit 4) with one line, its first device's
    queued jobs cancelled, instead of a traceback with jobs left behind."""
    from orchestrator.services import check as check_service

    settings, Session = farm  # noqa: N806
    now = store.utcnow()
    with Session() as s, s.begin():
        _devices_and_builds(s, builds=("b1", "b2"))
    app = make_celery(settings)
    launched = []

    def launch_then_reserve(*args, **kwargs):
        if launched:  # the second device: booked by bob since the check began
            with Session() as s, s.begin():
                store.reserve_device(s, store.get_device(s, "vphone-2"), "bob", now + dt.timedelta(hours=1))
        launched.append(kwargs["devices"])
        return launch_suite(*args, **kwargs)

    monkeypatch.setattr(check_service, "launch_suite", launch_then_reserve)
    request = check_service.CheckRequest(candidate="b2", baseline="b1", devices=["vphone-1", "vphone-2"],
                                         holder="ana", timeout_s=60)
    with pytest.raises(check_service.CheckFailed, match="round 0 could not start on vphone-2: .*reserved by bob") as failed:
        check_service.run_check(app, Session, request)
    assert failed.value.report["exit_code"] == 4
    with Session() as s:
        jobs = s.query(Job).all()
        assert jobs and {j.device.serial for j in jobs} == {"vphone-1"}
        assert {str(j.state) for j in jobs} == {"cancelled"}, [(j.id, j.state) for j in jobs]


def test_a_check_or_a_submission_naming_a_reserved_device_is_refused(cli):
    _add(cli, "vphone-1", "vphone-2")
    with cli.Session() as s, s.begin():
        store.create_build(s, tiny_manifest("b1", 1_700_000_000.0))
        store.create_build(s, tiny_manifest("b2", 1_700_086_400.0))
    cli("devices", "reserve", "vphone-1", "--for", "2h", "--as", "ana", "--note", "camera bug")
    result = cli("check", "--build", "b2", "--baseline", "b1", "--device", "vphone-1", ok=False)
    assert result.exit_code != 0
    assert "vphone-1 is reserved by ana until" in result.output and "(camera bug)" in result.output
    with cli.Session() as s:
        assert s.query(Job).count() == 0
        # "all" leaves it out, saying so (a CI gate's `farm check --all` runs on the rest); the
        # free one named alone is accepted
        skipped = []
        assert [d.serial for d in target_devices(s, "all", refuse_quarantined=True, skipped=skipped)] == ["vphone-2"]
        assert [e["device"] for e in skipped] == ["vphone-1"] and "reserved by ana" in skipped[0]["reason"]
        assert [d.serial for d in target_devices(s, ["vphone-2"], refuse_quarantined=True)] == ["vphone-2"]
        # the holder runs on what they hold: that is what they reserved it for
        assert [d.serial for d in target_devices(s, "all", refuse_quarantined=True, holder="ana")] == [
            "vphone-1", "vphone-2"]
        with pytest.raises(store.DeviceReserved):
            target_devices(s, ["vphone-1"], refuse_quarantined=True, holder="bob")
    # every device reserved: "all" has nothing to run on, and says who holds them
    cli("devices", "reserve", "vphone-2", "--for", "1h", "--as", "bob")
    with cli.Session() as s:
        with pytest.raises(store.StoreError, match="every device it runs on is reserved: vphone-1 is reserved by ana"):
            target_devices(s, "all", refuse_quarantined=True)


def test_a_ci_gate_over_all_devices_runs_on_those_nobody_holds(cli, monkeypatch, tmp_path):
    """`farm check --all` (the CI gate's command) while someone debugs a phone: the check runs on
    the other devices, and its output and report name the one left out and who holds it."""
    from orchestrator.services import check as gate

    _add(cli, "vphone-1", "vphone-2")
    with cli.Session() as s, s.begin():
        store.create_build(s, tiny_manifest("b1", 1_700_000_000.0))
        store.create_build(s, tiny_manifest("b2", 1_700_086_400.0))
    cli("devices", "reserve", "vphone-1", "--for", "2h", "--as", "ana", "--note", "camera bug")
    launched = []

    def launch(app, name, jobs, *, devices, **kwargs):
        launched.extend(devices)
        raise gate.CheckFailed("stopped here: the test needs no worker")

    monkeypatch.setattr(gate, "launch_suite", launch)
    monkeypatch.setenv("USER", "bob")
    report = tmp_path / "check.json"
    result = cli("check", "--build", "b2", "--baseline", "b1", "--all", "--json", str(report),
                 "--markdown", str(tmp_path / "check.md"), ok=False)
    assert launched == ["vphone-2"], result.output
    assert "left out: vphone-1 is reserved by ana until" in result.output
    skipped = json.loads(report.read_text())["skipped"]
    assert [(e["device"], e["holder"], e["note"]) for e in skipped] == [("vphone-1", "ana", "camera bug")]
    assert "Left out (reserved by a person" in (tmp_path / "check.md").read_text()


def test_the_holder_submits_jobs_to_the_device_they_hold(cli, monkeypatch):
    _add(cli, "vphone-1")
    with cli.Session() as s, s.begin():
        store.create_build(s, tiny_manifest("b1", 1_700_000_000.0))
    monkeypatch.setenv("USER", "ana")
    cli("devices", "reserve", "vphone-1", "--for", "2h")
    monkeypatch.setenv("USER", "bob")
    refused = cli("jobs", "submit", "latency", "--build", "b1", "--device", "vphone-1", ok=False)
    assert refused.exit_code == 3 and "reserved by ana" in refused.output
    monkeypatch.setenv("USER", "ana")
    cli("jobs", "submit", "latency", "--build", "b1", "--device", "vphone-1")
    with cli.Session() as s:
        assert [j.device.serial for j in s.query(Job)] == ["vphone-1"]


def test_schedules_run_now_and_list_name_the_devices_a_batch_skipped(cli):
    cli("devices", "add", "vphone-1", "--transport", "local")
    cli("devices", "add", "vphone-2", "--transport", "local")
    with cli.Session() as s, s.begin():
        store.create_build(s, tiny_manifest("b1", 1_700_000_000.0))
    cli("schedules", "add", "nightly", "--cron", "0 2 * * *")
    cli("devices", "reserve", "vphone-1", "--for", "2h", "--as", "ana", "--note", "camera bug")
    fired = cli("schedules", "run-now", "nightly").output
    assert "skipped vphone-1 is reserved by ana until " in fired and "(camera bug)" in fired
    listed = cli("schedules", "list").output
    assert "skipped vphone-1 is reserved by ana until " in " ".join(listed.split())
    [row] = json.loads(cli("schedules", "list", "--json").output)
    assert [e["device"] for e in row["last_batch_skipped"]] == ["vphone-1"] and row["last_batch"]
