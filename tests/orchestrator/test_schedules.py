"""Schedules: cron and time-zone validation, firing times across daylight-saving changes, due
schedules and their one-time claim (on SQLite and PostgreSQL), and `farm schedules ...`
through CliRunner, bad input included."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from page_devices import add_page_devices
from typer.testing import CliRunner

from orchestrator import store
from orchestrator.cli import app

UTC = dt.UTC
SUITE = {"build": None, "devices": "all", "jobs": [{"kind": "latency", "spec": {}}]}


@pytest.mark.parametrize("cron,zone,message", [
    ("0 2 * *", "UTC", "invalid cron expression"),
    ("61 2 * * *", "UTC", "invalid cron expression"),
    ("0 2 * * * *", "UTC", "invalid cron expression"),
    ("every night", "UTC", "invalid cron expression"),
    ("0 2 * * *", "Mars/Olympus", "unknown time zone"),
    ("0 0 31 2 *", "UTC", "names no date within 10 years"),  # February has no 31st: it would never fire
    ("0 0 30 2 *", "Europe/Paris", "names no date within 10 years"),
])
def test_bad_cron_or_zone_is_refused(cron, zone, message):
    with pytest.raises(store.StoreError, match=message):
        store.validate_cron(cron, zone)


def test_fire_times_follow_the_zone_and_daylight_saving():
    # 02:00 in Paris is 01:00 UTC in winter and 00:00 UTC in summer.
    assert store.next_fire_time("0 2 * * *", "Europe/Paris", dt.datetime(2026, 11, 21, 12, tzinfo=UTC)) == \
        dt.datetime(2026, 11, 22, 1, tzinfo=UTC)
    assert store.next_fire_time("0 2 * * *", "Europe/Paris", dt.datetime(2026, 7, 1, 12, tzinfo=UTC)) == \
        dt.datetime(2026, 7, 2, 0, tzinfo=UTC)
    # Across the spring change (29 March 2026, 02:00 -> 03:00 in Paris) the next firing is still one.
    fire = store.next_fire_time("30 1 * * *", "Europe/Paris", dt.datetime(2026, 3, 28, 12, tzinfo=UTC))
    assert fire == dt.datetime(2026, 3, 29, 0, 30, tzinfo=UTC)
    assert store.last_fire_time("*/15 * * * *", "UTC", dt.datetime(2026, 1, 1, 10, 14, tzinfo=UTC)) == \
        dt.datetime(2026, 1, 1, 10, 0, tzinfo=UTC)


def _firings(cron: str, zone: str, start: dt.datetime, end: dt.datetime) -> list[dt.datetime]:
    fires, at = [], start
    while (at := store.next_fire_time(cron, zone, at)) < end:
        fires.append(at)
    return fires


def test_a_repeated_hour_fires_once_and_a_skipped_one_once():
    """Paris on 2026-10-25: 03:00 CEST goes back to 02:00 CET, so 02:30 happens twice (00:30 and
    01:30 UTC); it fires once, at the first. On 2026-03-29 02:00 CET jumps to 03:00 CEST, so
    02:30 never happens; it fires once, when the clocks jump (01:00 UTC). Half-hourly, the
    skipped 02:00 and 02:30 and the 03:00 after them are one firing."""
    autumn = _firings("30 2 * * *", "Europe/Paris", dt.datetime(2026, 10, 24, 12, tzinfo=UTC),
                      dt.datetime(2026, 10, 26, 12, tzinfo=UTC))
    assert autumn == [dt.datetime(2026, 10, 25, 0, 30, tzinfo=UTC), dt.datetime(2026, 10, 26, 1, 30, tzinfo=UTC)]
    spring = _firings("30 2 * * *", "Europe/Paris", dt.datetime(2026, 3, 28, 12, tzinfo=UTC),
                      dt.datetime(2026, 3, 30, 12, tzinfo=UTC))
    assert spring == [dt.datetime(2026, 3, 29, 1, 0, tzinfo=UTC), dt.datetime(2026, 3, 30, 0, 30, tzinfo=UTC)]
    half_hourly = _firings("*/30 * * * *", "Europe/Paris", dt.datetime(2026, 3, 29, 0, 0, tzinfo=UTC),
                           dt.datetime(2026, 3, 29, 2, 1, tzinfo=UTC))
    assert [f.strftime("%H:%M") for f in half_hourly] == ["00:30", "01:00", "01:30", "02:00"]
    # The latest firing at or before a time in the repeated hour's second pass is its first pass.
    assert store.last_fire_time("30 2 * * *", "Europe/Paris", dt.datetime(2026, 10, 25, 1, 45, tzinfo=UTC)) == \
        dt.datetime(2026, 10, 25, 0, 30, tzinfo=UTC)
    # Every firing of a year in a zone with both changes: one a day, in order, no two alike.
    year = _firings("30 2 * * *", "Europe/Paris", dt.datetime(2026, 1, 1, tzinfo=UTC),
                    dt.datetime(2027, 1, 1, tzinfo=UTC))
    assert len(year) == 365 and len({f.date() for f in year}) == 365


def test_a_schedule_that_cannot_fire_never_stops_the_others(Session):  # noqa: N803
    """A stored schedule with a cron that names no date (stored before `add` checked it) made
    every beat tick raise before firing anything: every nightly run stopped, silently. It is
    left out with its error recorded; the others fire."""
    from orchestrator.store.models import Schedule

    now = store.utcnow()
    with Session() as session, session.begin():
        hourly = store.create_schedule(session, "hourly", "0 * * * *", "UTC", SUITE)
        hourly.last_run_at = now - dt.timedelta(hours=2)
        session.add(Schedule(name="leap", cron="0 0 31 2 *", timezone="UTC", suite=SUITE,
                             last_run_at=now - dt.timedelta(days=1)))
        session.add(Schedule(name="gone-zone", cron="0 * * * *", timezone="Atlantis/Capital", suite=SUITE,
                             last_run_at=now - dt.timedelta(days=1)))
        hourly_id = hourly.id
    with Session() as session, session.begin():
        due = store.due_schedules(session, now)
    assert [s.id for s, _ in due] == [hourly_id]
    with Session() as session:
        errors = {s.name: s.last_error for s in session.query(Schedule)}
    assert errors["hourly"] is None
    assert "never fire" in errors["leap"] and "Atlantis/Capital" in errors["gone-zone"], errors


def test_due_schedule_is_claimed_once(Session):  # noqa: N803
    now = store.utcnow()
    with Session() as session, session.begin():
        nightly = store.create_schedule(session, "nightly", "0 2 * * *", "Europe/Paris", SUITE)
        hourly = store.create_schedule(session, "hourly", "0 * * * *", "UTC", SUITE)
        off = store.create_schedule(session, "off", "* * * * *", "UTC", SUITE, enabled=False)
        # hourly's last firing was 3 hours ago: due (once, for the latest hour); nightly just made: not due
        hourly.last_run_at = now - dt.timedelta(hours=3)
        off.last_run_at = now - dt.timedelta(days=1)
        nightly_id, hourly_id = nightly.id, hourly.id
    with Session() as session:
        due = store.due_schedules(session, now)
    assert [(s.id, fire) for s, fire in due] == [(hourly_id, now.replace(minute=0, second=0, microsecond=0))]
    (_, fire), previous = due[0], due[0][0].last_run_at
    with Session() as session, session.begin():
        assert store.claim_schedule_firing(session, hourly_id, previous, fire)
    with Session() as session, session.begin():
        assert not store.claim_schedule_firing(session, hourly_id, previous, fire)  # a second beat loses
    with Session() as session:
        assert store.due_schedules(session, now) == []
        assert store.get_schedule(session, "hourly").last_run_at == fire
        with pytest.raises(store.StoreError, match="no schedule 'weekly'"):
            store.get_schedule(session, "weekly")
    with Session() as session, session.begin(), pytest.raises(store.StoreError, match="already exists"):
        store.create_schedule(session, "nightly", "0 3 * * *", "UTC", SUITE)
    assert nightly_id != hourly_id


@pytest.fixture
def farm(tmp_path, monkeypatch):
    monkeypatch.setenv("FARM_DATABASE_URL", f"sqlite:///{tmp_path / 'farm.db'}")
    monkeypatch.setenv("FARM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FARM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("FARM_HOST_NAME", "testhost")
    runner = CliRunner()

    def invoke(*args: str, code: int = 0):
        result = runner.invoke(app, list(args))
        assert result.exit_code == code, result.output
        return result

    invoke("db", "upgrade")
    invoke("devices", "add", "p1", "--transport", "local")
    return invoke


def test_schedules_cli_lifecycle(farm):
    out = farm("schedules", "add", "nightly", "--cron", "0 2 * * *", "--tz", "Europe/Paris", "--job", "latency",
               "--job", "generate", "--device", "p1", "--steps", "4", "--precision", "fp32").output
    assert "next run" in out
    (row,) = json.loads(farm("schedules", "list", "--json").output)
    assert row["name"] == "nightly" and row["enabled"] and row["devices"] == ["p1"]
    assert [j["kind"] for j in row["jobs"]] == ["latency", "generate"]
    # the repetitions' default (5, as in check and jobs submit) is written into the suite
    assert row["jobs"][0]["spec"] == {"steps": 4, "precision": "fp32", "repetitions": 5}
    next_at = dt.datetime.fromisoformat(row["next_run_at"])
    assert next_at.astimezone(dt.timezone(dt.timedelta(hours=1))).hour == 2  # 02:00 Paris (winter)
    farm("schedules", "disable", "nightly")
    (row,) = json.loads(farm("schedules", "list", "--json").output)
    assert not row["enabled"] and row["next_run_at"] is None
    farm("schedules", "enable", "nightly")
    assert "nightly" in farm("schedules", "list").output
    farm("schedules", "remove", "nightly")
    assert json.loads(farm("schedules", "list", "--json").output) == []


@pytest.mark.parametrize("args,message", [
    (["schedules", "add", "x", "--cron", "0 25 * * *"], "invalid cron expression"),
    (["schedules", "add", "x", "--cron", "0 2 * * *", "--tz", "Nowhere/City"], "unknown time zone"),
    (["schedules", "add", "x", "--cron", "0 2 * * *", "--job", "bake"], "unknown job kind 'bake'"),
    (["schedules", "add", "x", "--cron", "0 2 * * *", "--device", "ghost"], "no device 'ghost'"),
    (["schedules", "add", "x", "--cron", "0 2 * * *", "--build", "b404"], "no build 'b404'"),
    (["schedules", "add", "x", "--cron", "0 2 * * *", "--steps", "1000000000"], "steps must be in [1, 1000]"),
    (["schedules", "add", "x", "--cron", "0 2 * * *", "--resolution", "65536"], "height must be in [8, 4096]"),
    (["schedules", "add", "x", "--cron", "0 2 * * *", "--cooldown", "nan"], "max_celsius must be a finite number"),
    (["schedules", "enable", "ghost"], "no schedule 'ghost'"),
    (["schedules", "remove", "ghost"], "no schedule 'ghost'"),
    (["schedules", "run-now", "ghost"], "no schedule 'ghost'"),
])
def test_schedules_bad_input_is_one_error(farm, args, message):
    result = farm(*args, code=3)
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert json.loads(farm("schedules", "list", "--json").output) == []  # nothing half-written


def test_run_now_without_builds_is_one_error(farm):
    farm("schedules", "add", "nightly", "--cron", "0 2 * * *")
    result = farm("schedules", "run-now", "nightly", code=3)
    assert "no builds yet" in result.output and "Traceback" not in result.output


def test_a_schedule_cools_its_devices_down_before_each_job(cli_db):
    from sqlalchemy import select

    from agent.protocol import Manifest, ManifestFile
    from orchestrator import store
    from orchestrator.store.models import Job

    cli = cli_db
    cli("devices", "add", "p1", "--transport", "local")
    with cli.Session() as s, s.begin():
        store.create_build(s, Manifest(build="b1", version="0.1.0", created=1_700_000_000.0,
                                       files=[ManifestFile("models/tiny/model_index.json", "b" * 64, 20)]))
    cli("schedules", "add", "nightly", "--cron", "0 2 * * *", "--job", "tune", "--job", "latency",
        "--cooldown", "42", "--cooldown-wait", "120")
    (row,) = json.loads(cli("schedules", "list", "--json").output)
    assert [j["spec"]["cooldown"] for j in row["jobs"]] == [{"max_celsius": 42.0, "max_wait_s": 120.0}] * 2
    assert "<= 42 C, 120 s max" in cli("schedules", "list").output
    cli("schedules", "run-now", "nightly")
    with cli.Session() as s:
        jobs = s.scalars(select(Job).order_by(Job.id)).all()
        assert [(j.kind.value, j.spec["cooldown"]["max_celsius"], j.spec["cooldown"]["max_wait_s"])
                for j in jobs] == [("tune", 42.0, 120.0), ("latency", 42.0, 120.0)]
    for args, message in [(["--cooldown-wait", "60"], "--cooldown-wait needs --cooldown"),
                          (["--cooldown", "40", "--cooldown-wait", "-1"], "greater than or equal to 0")]:
        result = cli("schedules", "add", "x", "--cron", "0 2 * * *", *args, ok=False)
        assert message in result.output and "Traceback" not in result.output


def test_a_tuning_loop_schedule_times_the_tuned_profile_after_the_tune(cli_db):
    from sqlalchemy import select

    from agent.protocol import Manifest, ManifestFile
    from orchestrator import store
    from orchestrator.store.models import Job

    cli = cli_db
    cli("devices", "add", "p1", "--transport", "local")
    cli("devices", "add", "p2", "--transport", "local")
    with cli.Session() as s, s.begin():
        store.create_build(s, Manifest(build="b1", version="0.1.0", created=1_700_000_000.0,
                                       files=[ManifestFile("models/tiny/model_index.json", "b" * 64, 20)]))
    cli("schedules", "add", "tuning", "--cron", "0 3 * * 0", "--tuning-loop", "--steps", "4")
    (row,) = json.loads(cli("schedules", "list", "--json").output)
    assert [(j["kind"], j["spec"].get("profile")) for j in row["jobs"]] == [
        ("tune", None), ("latency", "family"), ("latency", "tuned")]
    assert "tune, latency (family), latency (tuned)" in cli("schedules", "list").output
    cli("schedules", "run-now", "tuning")
    with cli.Session() as s:
        jobs = s.scalars(select(Job).order_by(Job.id)).all()
        for device in ("p1", "p2"):
            tune, family, tuned = [j for j in jobs if j.device.serial == device]
            assert (tune.kind.value, family.spec["profile"], tuned.spec["profile"]) == ("tune", "family", "tuned")
            assert tuned.after_job_id == tune.id and family.after_job_id is None  # each device its own tune
            assert all(j.spec["steps"] == 4 for j in (tune, family, tuned))
    for args, message in [(["--tuning-loop", "--job", "latency"], "without --job"),
                          (["--tuning-loop", "--profile", "reference"], "without --profile")]:
        result = cli("schedules", "add", "x", "--cron", "0 2 * * *", *args, ok=False)
        assert result.exit_code == 3 and message in result.output and "Traceback" not in result.output


def test_schedules_list_shows_a_broken_schedule_and_beat_fires_the_rest(farm, tmp_path):
    """`schedules list` printed a traceback for a stored cron that names no date; now the row
    says "never" and a line names the error."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session as OrmSession

    from orchestrator.store.models import Schedule

    farm("schedules", "add", "nightly", "--cron", "0 2 * * *")
    engine = create_engine(f"sqlite:///{tmp_path / 'farm.db'}")
    with OrmSession(engine) as session, session.begin():
        session.add(Schedule(name="leap", cron="0 0 31 2 *", timezone="UTC", suite=SUITE))
    engine.dispose()
    out = farm("schedules", "list").output
    assert "Traceback" not in out and "never" in out
    assert any(line.startswith("schedule leap: cannot fire: cron expression '0 0 31 2 *' names no date")
               for line in out.splitlines()), out
    rows = {r["name"]: r for r in json.loads(farm("schedules", "list", "--json").output)}
    assert rows["nightly"]["next_run_at"] and rows["nightly"]["error"] is None
    assert rows["leap"]["next_run_at"] is None and "names no date" in rows["leap"]["error"]
    result = farm("schedules", "add", "leap2", "--cron", "0 0 31 2 *", code=3)
    assert "names no date" in result.output and "Traceback" not in result.output


def test_a_firing_fails_at_once_the_jobs_a_page_cannot_hold_and_runs_the_rest(cli, tiny_model_dir):
    """A schedule's job whose plan cannot fit a page's adapter (as its discovery recorded it)
    would only fail on the phone, every night: the firing records it failed, with the reasons,
    never sent or deployed for; the same job on the page that can hold it, and on a local
    device, is queued behind its deployment as usual."""
    from sqlalchemy import select

    from agent.protocol import Manifest, ManifestFile
    from orchestrator.store.models import Batch, Job

    cli("devices", "add", "host-1", "--transport", "local")
    add_page_devices(cli, Manifest(build="b1", version="0.1.0", created=1_700_000_000.0, files=[
        ManifestFile("models/tiny/model_index.json", "b" * 64, 20)]), tiny_model_dir)
    cli("schedules", "add", "nightly", "--cron", "0 2 * * *", "--job", "generate", "--precision", "fp32",
        "--steps", "2")
    fired = cli("schedules", "run-now", "nightly").output
    assert "(generate) failed at once: does not fit page-2's browser: max binding bytes" in fired
    assert "page-1" not in fired and "host-1" not in fired
    with cli.Session() as s:
        jobs = {j.device.serial: j for j in s.scalars(select(Job))}
        assert sorted(jobs) == ["host-1", "page-1", "page-2"]
        refused = jobs["page-2"]
        assert refused.state == "failed" and refused.deployment_id is None and refused.attempts == 0
        assert refused.error.startswith("does not fit page-2's browser: max binding bytes ")
        assert "> the adapter's max-storage-buffer-binding-size 65,536" in refused.error
        for serial in ("host-1", "page-1"):
            assert jobs[serial].state == "queued" and jobs[serial].deployment_id is not None and not jobs[serial].error
        assert s.scalar(select(Batch)).finished_at is None  # two of its jobs are still to run
    # a suite nothing of which fits ends at once: its batch is settled, not left open
    cli("schedules", "add", "page-2-only", "--cron", "0 2 * * *", "--job", "generate", "--precision", "fp32",
        "--device", "page-2")
    cli("schedules", "run-now", "page-2-only")
    with cli.Session() as s:
        batch = s.scalars(select(Batch).order_by(Batch.id)).all()[-1]
        assert [j.state for j in batch.jobs] == ["failed"] and batch.finished_at is not None
