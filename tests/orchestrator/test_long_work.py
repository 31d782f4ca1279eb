"""Long work talks (issue 41): deploy, check and `jobs submit --wait` say what each device's work
is doing when piped, name a host whose queue no worker consumes within seconds (with the
command that starts one), and a check with no worker, or out of time, ends "could not run"
(exit 4) promptly, cancels its jobs and still writes its JSON and Markdown. The watcher's
reminders are checked on a fake clock; the commands run on the `cli` farm with no worker at
all (the embedded broker holds their messages) and a short stale_after_s, so a host is silent
after HEARD_BEATS of 0.5 s beats."""

from __future__ import annotations

import datetime as dt
import json
import time
from contextlib import contextmanager

import pytest
from support import tiny_manifest, wait_until

from orchestrator import store
from orchestrator.infra.settings import load_settings
from orchestrator.services import progress as watched
from orchestrator.store.models import Job, JobState


@pytest.fixture
def farm(cli, monkeypatch):
    """Builds b1 and b2 and device p1 on host h1, last heard 2 h ago: no worker serves it."""
    monkeypatch.setenv("FARM_STALE_AFTER_S", "1.5")  # a worker would stamp h1 every 0.5 s
    with cli.Session() as session:
        for i in (1, 2):
            store.create_build(session, tiny_manifest(f"b{i}", 1_700_000_000.0 + 86400 * i))
        store.upsert_device(session, "p1", "local", "/nowhere", host="h1")
        store.get_or_create_host(session, "h1").last_seen = store.utcnow() - dt.timedelta(hours=2)
        session.commit()
    return cli


def _jobs(Session) -> list[Job]:  # noqa: N803
    with Session() as session:
        return list(session.query(Job).order_by(Job.id))


def _timed_lines(monkeypatch) -> list[tuple[float, str]]:
    """When each watch line is printed (CliRunner keeps only the text)."""
    said_at: list[tuple[float, str]] = []
    lines = watched.lines

    def timed(p):
        out = lines(p)
        said_at.extend((time.monotonic(), line) for line in out)
        return out

    monkeypatch.setattr(watched, "lines", timed)
    return said_at


def _first(said_at: list[tuple[float, str]], prefix: str) -> float:
    return next(at for at, line in said_at if line.startswith(prefix))


def test_check_with_no_worker_ends_could_not_run_with_its_reports(farm, monkeypatch):
    out_json, out_md = farm.tmp / "check.json", farm.tmp / "check.md"
    said_at = _timed_lines(monkeypatch)
    started = time.monotonic()
    result = farm("check", "--build", "b2", "--baseline", "b1", "--device", "p1", "--timeout", "600",
                  "--no-worker-timeout", "2", "--json", str(out_json), "--markdown", str(out_md), ok=False)
    took = time.monotonic() - started
    assert result.exit_code == 4, result.output
    assert _first(said_at, "no worker is consuming") - started < 10, result.output
    assert took < 30, (took, result.output)  # promptly, not at its --timeout of 600 s
    said = "no worker is consuming queue 'host.h1' (last heard 2 h ago): start one with `farm worker --host h1`"
    assert said in result.output
    assert "giving up in" in result.output  # said while it waited, before its error line
    error = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "could not run (0/6 jobs done)" in error[0], result.output
    jobs = _jobs(farm.Session)
    assert len(jobs) == 6 and {j.state for j in jobs} == {JobState.cancelled}
    assert all("its check could not go on" in j.error for j in jobs)
    report = json.loads(out_json.read_text())
    assert (report["exit_code"], report["outcome"]) == (4, "could_not_run")
    assert "no worker is consuming queue 'host.h1'" in report["reason"]
    assert (report["jobs_done"], report["jobs_total"], sorted(report["jobs_cancelled"])) == \
        (0, 6, sorted(j.id for j in jobs))
    markdown = out_md.read_text()
    assert markdown.startswith("## farm check: 🛑 could not run")
    assert "No verdict: ``the check could not run (0/6 jobs done): no worker is consuming queue 'host.h1'" in markdown
    assert "0 of its 6 jobs succeeded; 6 were cancelled" in markdown
    assert "| device |" not in markdown  # nothing was judged: no empty table


def test_check_out_of_time_with_a_worker_heard_cancels_and_reports(farm):
    """A host whose worker is alive (its heartbeat, as a real worker's) is not called silent;
    the check runs out of --timeout and still writes what it did."""
    from orchestrator.jobs.health import HostHeartbeat

    beat = HostHeartbeat(load_settings(), ["h1"]).start()
    try:
        assert wait_until(lambda: not watched.silent_hosts([_step(farm)], load_settings(), store.utcnow()))
        out_json, out_md = farm.tmp / "check.json", farm.tmp / "check.md"
        result = farm("check", "--build", "b2", "--baseline", "b1", "--device", "p1", "--no-images", "--timeout",
                      "3", "--no-worker-timeout", "1", "--json", str(out_json), "--markdown", str(out_md), ok=False)
    finally:
        beat.stop()
    assert result.exit_code == 4, result.output
    assert "no worker" not in result.output
    assert "the check ran out of time (0/4 jobs done)" in result.output
    assert "p1: latency job" in result.output and "queued" in result.output  # its jobs, line by line
    assert {j.state for j in _jobs(farm.Session)} == {JobState.cancelled}
    report = json.loads(out_json.read_text())
    assert report["outcome"] == "could_not_run" and "ran out of time" in report["reason"]
    assert "ran out of time" in out_md.read_text()


def _step(farm) -> watched.Step:
    with farm.Session() as session:
        device = store.get_device(session, "p1")
        return watched.Step("p1", "x", "queued", "h1", device.host.last_seen)


def test_deploy_with_no_worker_says_so_when_piped(farm, monkeypatch):
    (load_settings().data_dir / "builds" / "b2").mkdir(parents=True)
    said_at = _timed_lines(monkeypatch)
    started = time.monotonic()
    result = farm("deploy", "b2", "--device", "p1", "--timeout", "3", ok=False)
    assert _first(said_at, "no worker is consuming") - started < 10, result.output
    lines = result.output.splitlines()
    assert len(lines) > 1, (result.exit_code, result.output, result.exception)
    assert lines[0] == "p1: deploy b2 pending", result.output
    assert lines[1] == ("no worker is consuming queue 'host.h1' (last heard 2 h ago): start one with "
                        "`farm worker --host h1` on that host (or `farm up` on this one); waiting for one")
    assert "error: p1: still pending after 3 s (it goes on in its worker); no worker is consuming" in result.output
    assert result.exit_code == 4


def test_jobs_wait_with_no_worker_says_so(farm):
    result = farm("jobs", "submit", "latency", "--build", "b2", "--device", "p1", "--wait", "--timeout", "2",
                  ok=False)
    assert "p1: latency job 1 queued" in result.output
    assert "no worker is consuming queue 'host.h1'" in result.output
    assert "gave up waiting after 2 s" in result.output


def test_bisect_with_no_worker_says_so_while_it_waits(farm):
    """b3 regresses against b1 (their runs recorded); b2 in between has none, so bisect runs it,
    and with no worker it names the silent queue and gives up at --timeout."""
    import numpy as np
    from support import latency_result, record_job

    rng = np.random.default_rng(41)
    spec = {"model": "models/tiny", "precision": "fp32", "steps": 2, "prompt": "a red bicycle", "seed": 0}
    with farm.Session() as session:
        b3 = store.create_build(session, tiny_manifest("b3", 1_700_000_000.0 + 86400 * 3))
        device = store.get_device(session, "p1")
        for build, slow in ((store.get_build(session, "b1"), 1.0), (b3, 1.3)):
            record_job(session, "latency", spec, device.id, build.id, latency_result(rng, slow))
        store.get_or_create_host(session, "h1").last_seen = store.utcnow() - dt.timedelta(hours=2)
        session.commit()
    result = farm("bisect", "--good", "b1", "--bad", "b3", "--device", "p1", "--timeout", "2", ok=False)
    assert result.exit_code == 4, result.output
    assert "b3: regression against b1" in result.output
    assert "p1: latency job 3 queued" in result.output
    assert "no worker is consuming queue 'host.h1' (last heard 2 h ago)" in result.output
    assert "b2 did not finish on p1 within 2 s; no worker is consuming queue 'host.h1'" in result.output


def test_demo_follow_prints_each_change_when_piped(farm, capsys):
    """The demo's batch view through the shared watch: piped, a line per device's deployment and
    job, then its table once (before, only the table, at the end)."""
    from types import SimpleNamespace

    import numpy as np
    from support import latency_result, record_job

    from orchestrator.cli.demo import _follow
    from orchestrator.store.models import DeploymentStatus

    with farm.Session() as session:
        build, device = store.get_build(session, "b2"), store.get_device(session, "p1")
        batch = store.create_batch(session, "demo b2", build_id=build.id)
        store.create_deployment(session, build.id, device.id, batch_id=batch.id).status = DeploymentStatus.succeeded
        record_job(session, "latency", {"model": "models/tiny"}, device.id, build.id,
                   latency_result(np.random.default_rng(0), 1.0), batch_id=batch.id)
        batch.summary = {"analysis": {}}
        session.commit()
        batch_id = batch.id
    running = SimpleNamespace(devices=["p1"], stack=SimpleNamespace(check_alive=lambda: None, log_dir="/logs"))
    assert _follow(farm.Session, load_settings(), batch_id, "b2", running, time.monotonic() + 30)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[:2] == ["p1: deploy b2 succeeded", "p1: latency job 1 succeeded"], out
    assert f"batch {batch_id}" in lines[2] and "more repetitions" in out  # then the table, once


def test_api_check_with_no_worker_is_cancelled_with_its_report(farm):
    from orchestrator.api.check_runs import CheckRunner
    from orchestrator.jobs.celery_app import make_celery
    from orchestrator.services import check as gate
    from orchestrator.store.models import CheckRun, CheckState

    runner = CheckRunner(farm.Session, make_celery(load_settings()))
    request = gate.CheckRequest(candidate="b2", baseline="b1", devices=["p1"], images=False, timeout_s=600,
                                no_worker_s=1)
    with farm.Session() as session:
        check_id = runner.start(session, request, None).id
    assert wait_until(lambda: check_id not in runner.threads, timeout_s=30)  # not its 600 s
    with farm.Session() as session:
        row = session.get(CheckRun, check_id)
        assert (row.state, row.exit_code) == (CheckState.failed, 4)
        assert "no worker is consuming queue 'host.h1'" in row.error
        assert row.report["outcome"] == "could_not_run" and row.report["jobs_total"] == 4
    assert {j.state for j in _jobs(farm.Session)} == {JobState.cancelled}


# ---- the watcher, on a fake clock ---------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


@contextmanager
def _no_session():
    yield None


def test_watch_reports_changes_and_reminds_every_30_s(monkeypatch):
    clock = FakeClock()
    heard = store.utcnow()
    monkeypatch.setattr(watched.store, "utcnow", lambda: heard)  # the host stays freshly heard

    def read(_session) -> list[watched.Step]:
        state = "queued" if clock.t < 70 else "running" if clock.t < 80 else "succeeded"
        sent = None if clock.t < 70 else int(clock.t - 70) * 2**20
        return [watched.Step("p1", "latency job 1", state, "h1", heard),
                watched.Step("p2", "deploy b2", "running", "h1", heard, sent=sent, total=10 * 2**20)]

    said: list[str] = []
    ending = watched.watch(_no_session, load_settings(), read, lambda p: said.extend(watched.lines(p)),
                           done=lambda _s, steps: steps[0].ended, poll_s=1.0, clock=clock, sleep=clock.sleep)
    assert ending.reason == "done" and ending.done == "1/2"
    assert said[:2] == ["p1: latency job 1 queued", "p2: deploy b2 running"]
    assert said[2:6] == ["still waiting after 30 s: 0/2 done, 1 queued, 1 running",
                         "still waiting after 60 s: 0/2 done, 1 queued, 1 running",
                         "p1: latency job 1 running", "p2: deploy b2 running, 0.0 MiB / 10.0 MiB"]
    # bytes: a line per tenth sent, not per poll
    assert said[6:9] == ["p2: deploy b2 running, 1.0 MiB / 10.0 MiB", "p2: deploy b2 running, 2.0 MiB / 10.0 MiB",
                         "p2: deploy b2 running, 3.0 MiB / 10.0 MiB"]
    assert "p1: latency job 1 succeeded" in said[9:]


def test_a_host_is_silent_after_a_few_missed_beats(monkeypatch):
    monkeypatch.setenv("FARM_STALE_AFTER_S", "60")  # beats every 5 s: silent after 16 s
    settings, now = load_settings(), store.utcnow()
    step = watched.Step("p1", "x", "queued", "h1", now - dt.timedelta(seconds=10))
    assert watched.heard_within_s(settings) == 16.0
    assert watched.silent_hosts([step], settings, now) == []
    late = now + dt.timedelta(seconds=7)
    assert watched.silent_hosts([step], settings, late) == [watched.Silence("h1", step.heard)]
    never = watched.Step("p2", "x", "queued", "h2")
    assert watched.silent_hosts([never], settings, now)[0].text(now).startswith(
        "no worker is consuming queue 'host.h2' (never heard)")
    assert watched.silent_hosts([watched.Step("p3", "x", "succeeded", "h3")], settings, now) == []


def test_watch_stops_when_no_worker_appears_within_the_grace():
    clock = FakeClock()
    steps = [watched.Step("p1", "latency job 1", "queued", "h1", None)]
    reports: list[watched.Progress] = []
    ending = watched.watch(_no_session, load_settings(), lambda _s: steps, reports.append, no_worker_s=40,
                           timeout_s=3600, poll_s=1.0, clock=clock, sleep=clock.sleep)
    assert ending.reason == "no_worker" and clock.t == 40
    assert reports[0].why == "silence" and reports[0].silence_lines() == [
        "no worker is consuming queue 'host.h1' (never heard): start one with `farm worker --host h1` on that "
        "host (or `farm up` on this one); giving up in 40 s"]
    assert [p.why for p in reports if p.why != "poll"] == ["silence", "remind", "end"]
    assert len(reports) == 41  # one a poll: a live view's clock moves
