"""Each series' newest verdict as the farm API serves it (GET /v1/overview, /v1/series and
/v1/series/{id}: orchestrator/analysis/series.py latest_verdict, stored by the batch analysis in
the series row: analysis/series_state.py record_verdict): regression, improvement, inconclusive,
no change and not enough data, peak GPU memory as much as latency, each with the ratio and
interval the analysis computed for the newest build against its baseline.

A small store made here: builds b1 and b2, two latency runs of each per device; on `reg` b2's
UNet step and peak GPU memory are 30 % higher and its end-to-end time the same; on `imp` b2's
UNet step is 30 % lower and its peak GPU memory 26 % lower but so noisy that the analysis cannot
decide (the tester's 0.744x, interval 0.564-0.982, on host-gpu); `one` ran b1 only."""

from __future__ import annotations

import datetime as dt
import time

import numpy as np
import pytest
from alembic import command
from fastapi.testclient import TestClient
from support import record_job, tiny_manifest

from agent.protocol import JobResult, KernelTiming, Sample
from orchestrator import store
from orchestrator.analysis import regressions
from orchestrator.api import tokens
from orchestrator.api.app import create_app
from orchestrator.infra.settings import Settings
from orchestrator.store import make_engine, make_session_factory, migrate, upgrade

SPEC = {"model": "models/tiny", "precision": "fp32", "steps": 2, "prompt": "a red bicycle", "seed": 0}
PEAK = 1.4 * 2**30
# device -> metric -> (b2's level against b1's, relative noise of one sample)
PLAN = {"reg": {"unet_step_ms": (1.3, 0.005), "e2e_ms": (1.0, 0.001), "peak_gpu_bytes": (1.3, 0.001)},
        "imp": {"unet_step_ms": (0.7, 0.005), "e2e_ms": (1.0, 0.001), "peak_gpu_bytes": (0.744, 0.35)}}
WANT = {("reg", "unet_step_ms"): "regression", ("reg", "e2e_ms"): "no_change",
        ("reg", "peak_gpu_bytes"): "regression", ("imp", "unet_step_ms"): "improvement",
        ("imp", "e2e_ms"): "no_change", ("imp", "peak_gpu_bytes"): "inconclusive"}
BASE = {"unet_step_ms": 100.0, "e2e_ms": 2000.0, "peak_gpu_bytes": PEAK}
UNITS = {"unet_step_ms": "ms", "e2e_ms": "ms", "peak_gpu_bytes": "bytes"}


# The kernels a run timed (ms in one repetition): nine convolutions slower than any attention
# kernel, and b1's flash attention replaced in b2 by the reference attention and its softmax.
CONVS = {f"conv2d/{i}": 20.0 for i in range(9)}
KERNELS = {"b1": CONVS | {"attention/flash": 10.67}, "b2": CONVS | {"attention": 15.0, "softmax": 5.0}}


def _result(rng, levels: dict[str, tuple[float, float]], second: bool) -> JobResult:
    samples = []
    for metric, (level, noise) in levels.items():
        scale = BASE[metric] * (level if second else 1.0)
        samples += [Sample(metric, float(scale * rng.lognormal(0.0, noise)), UNITS[metric], r) for r in range(10)]
    kernels = [KernelTiming(k, 4, float(ms * rng.lognormal(0.0, 0.01)), r)
               for r in range(10) for k, ms in KERNELS["b2" if second else "b1"].items()]
    return JobResult(job_id="j", kind="latency", status="succeeded", samples=samples, kernel_timings=kernels)


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    root = tmp_path_factory.mktemp("verdicts")
    url = f"sqlite:///{root / 'farm.db'}"
    settings = Settings(data_dir=root / "data", config_dir=root / "config", host_name="h", database_url=url)
    upgrade(url)
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    rng = np.random.default_rng(41)
    with sessions() as s, s.begin():
        devices = {serial: store.upsert_device(s, serial, "local", f"/tmp/{serial}", host="h")
                   for serial in ("imp", "one", "reg")}
        batches = {}
        for i, name in enumerate(("b1", "b2"), start=1):
            build = store.create_build(s, tiny_manifest(name, 1_700_000_000.0 + 86400 * i))
            batches[name] = store.create_batch(s, f"nightly {name}", build_id=build.id).id
            for serial, device in devices.items():
                if serial == "one" and name == "b2":
                    continue
                levels = PLAN.get(serial, PLAN["reg"])
                for _ in range(2):
                    record_job(s, "latency", SPEC, device.id, build.id, _result(rng, levels, name == "b2"),
                               batch_id=batches[name])
        token = tokens.create_token(s, "read", "read token")[1]
    with sessions() as s, s.begin():
        for name in ("b1", "b2"):  # kept as orchestrator/jobs/batch_analysis.py keeps it
            report = regressions.analyze_batch(s, batches[name])
            store.get_batch(s, batches[name]).summary = {"analysis": report}
    client = TestClient(create_app(settings), headers={"Authorization": f"Bearer {token}"})
    yield {"client": client, "report": report, "sessions": sessions, "batches": batches, "url": url}
    engine.dispose()


def _cells(client) -> dict[tuple[str, str], dict]:
    overview = client.get("/v1/overview")
    assert overview.status_code == 200, overview.text
    return {(c["device"], c["metric"]): c for c in overview.json()["cells"]}


def test_the_overview_carries_each_series_verdict_as_the_analysis_made_it(farm):
    cells = _cells(farm["client"])
    compared = {(c["device"], c["metric"]): c for c in farm["report"]["comparisons"] if "metric" in c}
    assert {k: cells[k]["latest_verdict"]["verdict"] for k in WANT} == WANT
    for key in WANT:
        verdict, made = cells[key]["latest_verdict"], compared[key]
        assert (verdict["ratio"], verdict["ci_low"], verdict["ci_high"], verdict["p_value"]) == (
            made["ratio"], made["ci_low"], made["ci_high"], made["p_value"]), key
        assert (verdict["build"], verdict["baseline_build"], verdict["on_latest"]) == ("b2", "b1", True)
        assert verdict["settled"] == (WANT[key] != "inconclusive") and verdict["reason"] == made["reason"]
    memory = cells[("imp", "peak_gpu_bytes")]["latest_verdict"]
    assert memory["ratio"] == pytest.approx(0.744, abs=0.15) and memory["ci_low"] < memory["ratio"] < memory["ci_high"]
    assert cells[("imp", "peak_gpu_bytes")]["verdict"] is None  # no alert: inconclusive is no finding
    for metric in BASE:  # one build: nothing to compare with
        alone = cells[("one", metric)]["latest_verdict"]
        assert (alone["verdict"], alone["settled"], alone["ratio"], alone["build"]) == (
            "not_enough_data", False, None, None)


def test_migration_0026_fills_each_series_verdict_from_the_analysed_batches(farm):
    """A store analysed before the series kept its verdict: upgrading to 0026 reads each
    series' newest comparison from the batches' stored summaries, the same as the analysis keeps."""
    before = {k: c["latest_verdict"] for k, c in _cells(farm["client"]).items()}
    assert any(v["verdict"] == "inconclusive" for v in before.values())
    command.downgrade(migrate.alembic_config(farm["url"]), "0025")
    upgrade(farm["url"])
    assert {k: c["latest_verdict"] for k, c in _cells(farm["client"]).items()} == before


def test_a_series_and_the_listing_carry_the_same_verdict(farm):
    client = farm["client"]
    cells = _cells(client)
    listed = client.get("/v1/series", params={"metric": "peak_gpu_bytes"}).json()
    assert {s["key"]["device"]: s["latest_verdict"]["verdict"] for s in listed} == {
        "imp": "inconclusive", "one": "not_enough_data", "reg": "regression"}
    for key in WANT:
        one = client.get(f"/v1/series/{cells[key]['series_id']}").json()
        assert one["latest_verdict"] == cells[key]["latest_verdict"]


def test_a_series_names_every_kernel_that_moved_between_the_builds_compared(farm):
    """b1's flash attention is slower than none of b2's nine convolutions, yet it is the kernel
    that moved (with the attention and softmax that replaced it): named in the kernel trend,
    never summed into "other", and listed biggest change first, as an alert's attribution."""
    client = farm["client"]
    ident = _cells(client)[("reg", "unet_step_ms")]["series_id"]
    kernels = client.get(f"/v1/series/{ident}/kernels").json()
    assert kernels["builds"] == ["b1", "b2"] and kernels["compared"] == {"baseline_build": "b1", "build": "b2"}
    moves = kernels["moves"]
    assert [m["kernel"] for m in moves[:3]] == ["attention", "attention/flash", "softmax"]
    assert [abs(m["delta_ms"]) for m in moves] == sorted((abs(m["delta_ms"]) for m in moves), reverse=True)
    assert moves[1]["baseline_ms"] == pytest.approx(10.67, rel=0.05) and moves[1]["candidate_ms"] == 0
    lines = {line["kernel"]: line["ms"] for line in kernels["kernels"]}
    assert {m["kernel"] for m in moves} <= set(lines)  # every kernel that moved, by name
    assert lines["attention/flash"][0] == pytest.approx(10.67, rel=0.05) and lines["attention/flash"][1] is None
    assert lines["attention"][0] is None and lines["softmax"][1] == pytest.approx(5.0, rel=0.05)
    assert not any(k.startswith("other") for k in lines)  # 12 kernels, each of them moved a little


def test_a_device_is_seen_when_its_result_is_recorded(farm):
    """The device page's "last seen" is never before its last run's end: a result recorded
    stamps the device (it was last probed an hour before the run ended here)."""
    now = time.time()
    with farm["sessions"]() as s, s.begin():
        device = store.get_device(s, "one")
        device.last_seen = store.utcnow() - dt.timedelta(hours=1)
        build = next(b for b in store.builds_in_order(s) if b.name == "b1")
        result = JobResult(job_id="g", kind="generate", status="succeeded", started_at=now - 2, finished_at=now)
        record_job(s, "generate", SPEC, device.id, build.id, result)
    client = farm["client"]
    seen = dt.datetime.fromisoformat(client.get("/v1/devices/one").json()["last_seen"])
    ended = dt.datetime.fromisoformat(client.get("/v1/devices/one/health").json()["last_run_finished"])
    assert ended == dt.datetime.fromtimestamp(now, dt.UTC) and seen >= ended


def test_a_newer_build_not_analysed_yet_keeps_the_verdict_with_its_build(farm):
    """(Last: it adds b3 to the module's store.) b3 measured on reg but its batch not analysed: the verdict stays b2's, not about the newest
    build; analysing b2's batch again later does not replace a newer build's verdict."""
    rng = np.random.default_rng(7)
    with farm["sessions"]() as s, s.begin():
        device = store.get_device(s, "reg")
        build = store.create_build(s, tiny_manifest("b3", 1_700_000_000.0 + 86400 * 3))
        batch = store.create_batch(s, "nightly b3", build_id=build.id)
        record_job(s, "latency", SPEC, device.id, build.id, _result(rng, PLAN["reg"], True), batch_id=batch.id)
    cell = _cells(farm["client"])[("reg", "unet_step_ms")]
    assert cell["latest"]["build"] == "b3"
    assert (cell["latest_verdict"]["verdict"], cell["latest_verdict"]["build"],
            cell["latest_verdict"]["on_latest"]) == ("regression", "b2", False)
    with farm["sessions"]() as s, s.begin():
        regressions.analyze_batch(s, batch.id)  # b3 against b2 (b2 is regressed: against b1)
    after = _cells(farm["client"])[("reg", "unet_step_ms")]["latest_verdict"]
    assert (after["build"], after["on_latest"]) == ("b3", True)
    with farm["sessions"]() as s, s.begin():
        regressions.analyze_batch(s, farm["batches"]["b2"])
    again = _cells(farm["client"])[("reg", "unet_step_ms")]["latest_verdict"]
    assert (again["build"], again["baseline_build"]) == ("b3", after["baseline_build"])
