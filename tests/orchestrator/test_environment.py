"""Every run carries its environment, on SQLite and PostgreSQL: the store keeps what the agent
recorded (or the device's record, marked so, for an older agent), migration 0009 adds the
columns to runs stored before; the analysis keys series by the recorded environment, compares
a candidate with a baseline of its own environment where one exists, and reports a driver
update between baseline and candidate as an environment change, never as a plain build
regression: in the comparison, the alert, `farm regressions`, `farm results compare` and
`farm results show`."""

from __future__ import annotations

import json

import numpy as np
from alembic import command
from sqlalchemy import func, select
from support import record_job, tiny_manifest

from agent.protocol import DeviceInfo, JobResult, JobSpec, RunEnvironment, Sample, to_dict
from orchestrator import store
from orchestrator.analysis import regressions
from orchestrator.store import environment as run_env
from orchestrator.store import make_engine, make_session_factory, migrate, upgrade
from orchestrator.store.models import Alert, AlertKind, AlertState, Run
from orchestrator.store.models import Sample as SampleRow

SPEC = {"model": "models/tiny", "precision": "fp32", "steps": 2, "prompt": "a red bicycle", "seed": 0}
ADAPTER = {"vendor": "qualcomm", "architecture": "adreno-7xx", "device": "Adreno (TM) 740", "backend": "Vulkan",
           "adapter_type": "IntegratedGPU", "vendor_id": 20803, "device_id": 1124, "description": "512.3"}


def _env(driver: str = "512.3", **kw) -> RunEnvironment:
    identity = {k: v for k, v in ADAPTER.items() if k != "description"}
    return RunEnvironment(**({"os": "android", "os_version": "14", "os_build": "samsung/dm3q/14/UP1A:user",
                              "kernel": "5.15.94-android13", "driver": driver, "adapter": identity,
                              "runtime": {"kind": "wgpu-native", "version": "29.0.1.1"},
                              "clocks_mhz": {"gpu": 680.0}, "profile": {"name": "adreno", "sha256": "ab" * 32}}
                             | kw))


def _latency(rng, slow: float, environment: RunEnvironment | None, reps: int = 20) -> JobResult:
    steps = 100.0 * slow * rng.lognormal(0.0, 0.01, reps)
    return JobResult(job_id="j", kind="latency", status="succeeded", environment=environment,
                     engine={"profile": "adreno"},
                     samples=[Sample("unet_step_ms", float(v), "ms", r) for r, v in enumerate(steps)])


def _record(session, device_id: int, build_id: int, result: JobResult, batch_id: int | None = None) -> Run:
    return record_job(session, "latency", SPEC, device_id, build_id, result, batch_id=batch_id)


def _phone(session, driver: str = "512.3"):
    info = DeviceInfo(serial="p1", model="SM-S918B", manufacturer="samsung", os="android", os_version="14",
                      adapter=ADAPTER | {"description": driver},
                      properties={"ro.build.fingerprint": "samsung/dm3q/14/UP1A:user"})
    return store.upsert_device(session, "p1", "adb", "127.0.0.1:5555", info=info, host="h")


def _build(session, name: str, day: int):
    return store.create_build(session, tiny_manifest(name, 1_700_000_000.0 + 86400 * day))


def _unet(report: dict) -> dict:
    (c,) = [c for c in report["comparisons"] if c.get("metric") == "unet_step_ms"]
    return c


# ---- the environment's identity --------------------------------------------------------------


def test_the_key_is_the_environments_identity_and_changes_read_as_words():
    env = to_dict(_env())
    same = to_dict(_env(clocks_mhz={"gpu": 220.0}, profile={"name": "tuned-740"}))
    assert run_env.environment_key(env) == run_env.environment_key(same)  # clocks and profile: no part of it
    assert len(run_env.environment_key(env)) == run_env.ENVIRONMENT_KEY_CHARS
    updated = to_dict(_env("530.1", os_build="samsung/dm3q/14/UP1A.2:user"))
    assert run_env.environment_key(updated) != run_env.environment_key(env)
    assert run_env.changes(env, updated) == ["OS build changed samsung/dm3q/14/UP1A:user -> samsung/dm3q/14/UP1A.2:user",
                                             "driver changed 512.3 -> 530.1"]
    assert run_env.changes(env, same) == []
    browser = to_dict(_env(runtime={"kind": "browser", "name": "Chrome", "version": "131.0"}))
    assert run_env.changes(env, browser) == ["WebGPU runtime changed wgpu-native 29.0.1.1 -> Chrome 131.0"]
    assert run_env.label(updated) == "android 14 / 530.1"
    record = run_env.from_device_record(os="android", os_version="14", driver="512.3",
                                        info={"adapter": ADAPTER, "properties": {}})
    assert run_env.changes(record, env) == [
        "OS build changed (not recorded) -> samsung/dm3q/14/UP1A:user",
        "kernel changed (not recorded) -> 5.15.94-android13",
        "WebGPU runtime changed (not recorded) -> wgpu-native 29.0.1.1",
        "the baseline's environment is the device's record, not the run's (its agent sent none)"]


# ---- the store -------------------------------------------------------------------------------


def test_a_run_stores_its_environment_or_the_devices_record_marked_so(Session):  # noqa: N803
    rng = np.random.default_rng(1)
    with Session() as s, s.begin():
        device = _phone(s)
        build = _build(s, "b1", 1)
        recorded = _record(s, device.id, build.id, _latency(rng, 1.0, _env("530.1")))
        old_agent = _record(s, device.id, build.id, _latency(rng, 1.0, None))
        ids = recorded.id, old_agent.id
    with Session() as s:
        recorded, old_agent = (s.get(Run, i) for i in ids)
        assert recorded.environment == to_dict(_env("530.1"))
        assert recorded.env_key == run_env.environment_key(to_dict(_env("530.1")))
        # An agent that sent no environment: the device's record at record time, marked so.
        assert old_agent.environment["source"] == run_env.DEVICE_RECORD
        assert (old_agent.environment["os"], old_agent.environment["os_version"],
                old_agent.environment["driver"]) == ("android", "14", "512.3")
        assert old_agent.environment["os_build"] == "samsung/dm3q/14/UP1A:user"
        assert old_agent.environment["profile"] == {"name": "adreno"}  # as the result's engine says
        assert old_agent.environment["runtime"] == {} and old_agent.environment["clocks_mhz"] == {}
        assert old_agent.env_key == run_env.environment_key(old_agent.environment) != recorded.env_key


def test_migration_0009_gives_earlier_runs_an_empty_environment(db_url):
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        with make_session_factory(engine)() as s, s.begin():
            device = _phone(s)
            run_id = _record(s, device.id, _build(s, "b1", 1).id,
                             _latency(np.random.default_rng(2), 1.0, _env())).id
        config = migrate.alembic_config(db_url)
        command.downgrade(config, "0008")  # the columns go, the run and its samples stay
        command.upgrade(config, "0009")
        runs = Run.__table__
        with engine.connect() as conn:
            assert conn.execute(select(runs.c.environment, runs.c.env_key).where(runs.c.id == run_id)).one() == ({}, "")
            assert conn.execute(select(func.count()).select_from(SampleRow.__table__)).scalar_one() == 20
        command.upgrade(config, "head")
        with make_session_factory(engine)() as s:
            run = s.get(Run, run_id)
            # The analysis reads the device's record for such a run.
            assert regressions.run_environment(run, run.job.device)["source"] == run_env.DEVICE_RECORD
            assert regressions.env_key_of(run, run.job.device) == run_env.environment_key(
                store.result_environment(run.job.device))
    finally:
        engine.dispose()


# ---- the analysis ----------------------------------------------------------------------------


def test_a_driver_update_is_an_environment_change_not_a_build_regression(Session):  # noqa: N803
    """b1, b2 on driver 512.3; the phone updates to 530.1, which makes everything 30% slower;
    b3 (no slower than b2 in itself) runs on the new driver. b3 against b2 crosses the update:
    the verdict and the alert say "environment changed: driver changed 512.3 -> 530.1" and b2
    is to be measured again there. b4 on the new driver is compared with b3 (its environment),
    and once b2 has run on the new driver, b3 against b2 is "same" and b3's alert is closed."""
    rng = np.random.default_rng(20261125)
    old, new = _env("512.3"), _env("530.1")
    with Session() as s, s.begin():
        device = _phone(s)
        b1, b2, b3, b4 = (_build(s, f"b{i}", i) for i in range(1, 5))
        batches = {}
        for build, env, slow in ((b1, old, 1.0), (b2, old, 1.0), (b3, new, 1.3), (b4, new, 1.3)):
            batches[build.name] = store.create_batch(s, f"nightly {build.name}", build_id=build.id).id
            _record(s, device.id, build.id, _latency(rng, slow, env), batches[build.name])
        # A setting made for the series in any environment holds in each one.
        regressions.set_min_effect(s, regressions.series_key(device, regressions.SpecKey.of(SPEC), "unet_step_ms"), 0.1)
        first = regressions.analyze_batch(s, batches["b2"])
        across = regressions.analyze_batch(s, batches["b3"])
        after = regressions.analyze_batch(s, batches["b4"])
        ids = {"b2": b2.id, "b3": b3.id, "device": device.id}
    c2 = _unet(first)
    assert c2["verdict"] == "same" and c2["environment_change"] == [] and c2["min_effect"] == 0.1
    c3 = _unet(across)
    assert (c3["baseline_build"], c3["verdict"]) == ("b2", "regression") and 1.25 < c3["ratio"] < 1.35
    assert c3["environment_change"] == ["driver changed 512.3 -> 530.1"]
    assert c3["reason"].startswith("environment changed: driver changed 512.3 -> 530.1; ")
    assert (c3["baseline_environment"], c3["environment"]) == ("android 14 / 512.3", "android 14 / 530.1")
    assert c3["min_effect"] == 0.1
    # ... and asks for b2 to be measured again, in the new environment, beside b3.
    # Every metric is measured again: the comparison across the change decided none of them.
    # The spec as stored: the whole JobSpec, less what names its job.
    whole = store.workload(to_dict(JobSpec(job_id="any", kind="latency", **SPEC)))
    assert across["more_repetitions"] == [{"device": "p1", "spec": whole, "repetitions": 20, "baseline_build": ids["b2"],
                                           "metrics": ["unet_step_ms", "e2e_ms", "peak_gpu_bytes"],
                                           "environment_change": ["driver changed 512.3 -> 530.1"]}]
    with Session() as s:
        (alert,) = [s.get(Alert, i) for i in across["alerts"]]
        assert alert.kind == AlertKind.regression
        assert alert.summary.startswith("environment changed: driver changed 512.3 -> 530.1; unet_step_ms +")
        assert "not the build's alone" in alert.summary
        assert alert.detail["environment_change"] == ["driver changed 512.3 -> 530.1"]
        assert alert.series["environment"] == run_env.environment_key(to_dict(new))
        alert_id = alert.id
    # b4 ran on the new driver: its baseline is b3, measured there (b3's alert does not say b3
    # is worse, so it does not keep b3 from being a baseline).
    c4 = _unet(after)
    assert (c4["baseline_build"], c4["verdict"], c4["environment_change"]) == ("b3", "same", [])
    assert after["alerts"] == [] and after["more_repetitions"] == []
    # The more-repetitions round: b3 again and b2 on the new driver. Within one environment
    # b3 is no slower than b2; the alert raised across the update is closed, saying why.
    with Session() as s, s.begin():
        batch = store.create_batch(s, "nightly b3 (more repetitions, round 1)", build_id=ids["b3"],
                                   idempotency_key=f"more:{batches['b3']}:1:p1")
        _record(s, ids["device"], ids["b3"], _latency(rng, 1.3, new), batch.id)
        _record(s, ids["device"], ids["b2"], _latency(rng, 1.3, new), batch.id)
        again = regressions.analyze_batch(s, batch.id)
    c3_again = _unet(again)
    assert (c3_again["baseline_build"], c3_again["verdict"], c3_again["environment_change"]) == ("b2", "same", [])
    assert c3_again["other_environment_runs"] != []  # b2's run on the old driver is left out
    with Session() as s:
        alert = s.get(Alert, alert_id)
        assert alert.state == AlertState.invalid
        assert alert.note.startswith("measured again in one environment (android 14 / 530.1) against b2: same")


def test_history_and_drift_are_read_within_one_environment(Session):  # noqa: N803
    rng = np.random.default_rng(5)
    old, new = _env("512.3"), _env("530.1")
    with Session() as s, s.begin():
        device = _phone(s)
        builds = [_build(s, f"h{i}", i) for i in range(8)]
        for i, build in enumerate(builds):
            _record(s, device.id, build.id, _latency(rng, 1.0 if i < 6 else 1.3, old if i < 6 else new))
        spec = regressions.SpecKey.of(SPEC)
        new_key = run_env.environment_key(to_dict(new))
        history = regressions.series_history(s, device, spec, "unet_step_ms", environment=new_key)
        assert [h["build"] for h in history] == ["h6", "h7"]
        assert len(regressions.series_history(s, device, spec, "unet_step_ms")) == 8
        # Six runs on the old driver are enough history there; none on the new one.
        assert regressions.series_drift(s, device, spec, "unet_step_ms", builds[7], environment=new_key)[1] == 0
        assert regressions.series_drift(s, device, spec, "unet_step_ms", builds[7],
                                     environment=run_env.environment_key(to_dict(old)))[1] == 6


# ---- the CLI -----------------------------------------------------------------------------


def test_cli_shows_the_driver_change(cli_db):
    """`farm regressions list|show`, `farm results compare` and `farm results show` say that
    the driver changed between baseline and candidate, on SQLite and PostgreSQL."""
    rng = np.random.default_rng(11)
    with cli_db.Session() as s, s.begin():
        device = _phone(s)
        b1, b2 = _build(s, "b1", 1), _build(s, "b2", 2)
        _record(s, device.id, b1.id, _latency(rng, 1.0, _env("512.3")))
        batch = store.create_batch(s, "nightly b2", build_id=b2.id)
        run_id = _record(s, device.id, b2.id, _latency(rng, 1.3, _env("530.1")), batch.id).id
        report = regressions.analyze_batch(s, batch.id)
    (alert_id,) = report["alerts"]
    listing = cli_db("regressions", "list", "--alerts").output
    assert "environment changed" in listing and "driver changed 512.3 -> 530.1" in listing
    shown = cli_db("regressions", "show", str(alert_id)).output
    assert "environment changed: driver changed 512.3 -> 530.1" in shown
    assert "environment: android 14 / 530.1" in shown
    as_json = json.loads(cli_db("regressions", "show", str(alert_id), "--json").output)
    assert as_json["detail"]["environment_change"] == ["driver changed 512.3 -> 530.1"]
    compared = cli_db("results", "compare", "--build", "b1", "--build", "b2").output
    assert "regression (environment changed: driver changed 512.3 -> 530.1)" in " ".join(compared.split())
    rows = json.loads(cli_db("results", "compare", "--build", "b1", "--build", "b2", "--json").output)
    assert [r["environment_change"] for r in rows] == [["driver changed 512.3 -> 530.1"]]
    run = cli_db("results", "show", str(run_id)).output
    for line in ("driver", "530.1", "kernel", "5.15.94-android13", "wgpu-native 29.0.1.1", "gpu 680 MHz",
                 "adreno sha256 abababababab", "the agent, at run time"):
        assert line in run, (line, run)
    data = json.loads(cli_db("results", "show", str(run_id), "--json").output)
    assert data["environment"] == to_dict(_env("530.1"))
    assert data["env_key"] == run_env.environment_key(data["environment"])


def test_same_environment_says_nothing_about_environments(Session):  # noqa: N803
    """Baseline and candidate in one environment: no environment change, the verdict's words
    are the statistics' own."""
    rng = np.random.default_rng(3)
    with Session() as s, s.begin():
        device = _phone(s)
        b1, b2 = _build(s, "b1", 1), _build(s, "b2", 2)
        _record(s, device.id, b1.id, _latency(rng, 1.0, _env()))
        batch = store.create_batch(s, "nightly b2", build_id=b2.id)
        _record(s, device.id, b2.id, _latency(rng, 1.3, _env()), batch.id)
        report = regressions.analyze_batch(s, batch.id)
        (alert,) = [s.get(Alert, i) for i in report["alerts"]]
        assert not alert.summary.startswith("environment changed") and alert.detail["environment_change"] == []
    c = _unet(report)
    assert c["verdict"] == "regression" and c["environment_change"] == [] and "environment" not in c["reason"]
    assert report["more_repetitions"] == []
