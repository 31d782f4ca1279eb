"""`farm regressions scan` on each store (SQLite, then PostgreSQL): change-point detection over
whole series histories, on its own, recording what it finds; and the analysis of a batch
scanning the series its devices fed."""

from __future__ import annotations

import json

import numpy as np
from sqlalchemy import select
from test_analysis import _latency, _manifest, _record

from orchestrator import store
from orchestrator.analysis import changepoints, regressions
from orchestrator.store.models import ChangePoint


def _history(cli, levels: dict[str, list[float]], reps: int = 10) -> dict[str, int]:
    """Builds b1..bN one day apart, and per device one latency run of each at its level."""
    rng = np.random.default_rng()
    batches = {}
    with cli.Session() as s, s.begin():
        n = len(next(iter(levels.values())))
        builds = [store.create_build(s, _manifest(f"b{i}", 1_700_000_000.0 + 86400 * i)) for i in range(1, n + 1)]
        for serial, slows in levels.items():
            device = store.upsert_device(s, serial, "local", f"/tmp/{serial}", host="h")
            for build, slow in zip(builds, slows, strict=True):
                batch = store.create_batch(s, f"nightly {build.name} {serial}", build_id=build.id)
                _record(s, device.id, build.id, "latency", _latency(rng, slow, reps=reps), batch.id)
                batches[f"{serial}:{build.name}"] = batch.id
    return batches


def test_scan_finds_and_records_each_series_change_point(cli_db):
    cli = cli_db
    assert "no change points" in cli("regressions", "scan").output
    _history(cli, {"p1": [1.0] * 8 + [1.3] * 8, "p2": [1.0] * 16})
    found = json.loads(cli("regressions", "scan", "--json").output)
    assert [(f["device"], f["metric"], f["build"], f["new"]) for f in found] == [("p1", "unet_step_ms", "b9", True)]
    (point,) = found
    assert 1.2 < point["ratio"] < 1.4 and point["p_value"] <= 0.01 and point["builds_in_history"] == 16
    assert point["ratio"] == point["median_after"] / point["median_before"]
    with cli.Session() as s:
        (row,) = s.scalars(select(ChangePoint)).all()
        assert (row.device.serial, row.build.name, row.metric) == ("p1", "b9", "unet_step_ms")
    again = json.loads(cli("regressions", "scan", "--device", "p1", "--json").output)
    assert [(f["build"], f["new"]) for f in again] == [("b9", False)]  # found again, recorded once
    with cli.Session() as s:
        assert len(s.scalars(select(ChangePoint)).all()) == 1
    assert json.loads(cli("regressions", "scan", "--device", "p2", "--json").output) == []
    assert json.loads(cli("regressions", "scan", "--metric", "e2e_ms", "--json").output) == []
    text = cli("regressions", "scan").output
    assert "1 change points (0 new)" in text and "b9" in text
    for args, message in [(["--metric", "fps"], "unknown metric 'fps'"), (["--device", "ghost"], "no device 'ghost'")]:
        result = cli("regressions", "scan", *args, ok=False)
        assert result.exit_code == 3 and message in result.output and "Traceback" not in result.output


def test_a_short_history_has_no_change_point(Session):  # noqa: N803
    """Fewer than two minimum segments of builds: nothing to split, whatever the values."""
    from types import SimpleNamespace

    cli = SimpleNamespace(Session=Session)
    _history(cli, {"p1": [1.0, 1.0, 1.0, 2.0, 2.0]})
    with Session() as s:
        assert changepoints.scan_change_points(s) == []


def test_a_level_move_under_the_minimum_effect_is_not_a_change_point(Session):  # noqa: N803
    from types import SimpleNamespace

    # 2%: significant (100 samples a build: each build's median is ~0.25% noisy; with 40, one
    # noisy build in a few hundred histories moved the split a build early), and small
    _history(SimpleNamespace(Session=Session), {"p1": [1.0] * 8 + [1.02] * 8}, reps=100)
    with Session() as s:
        assert changepoints.scan_change_points(s) == []
        key = regressions.series_key(store.get_device(s, "p1"), regressions.SpecKey.of(
            {"model": "models/tiny", "precision": "fp32", "steps": 2}), "unet_step_ms")
        regressions.set_min_effect(s, key, 0.01)  # a series where 1% matters
        (point,) = changepoints.scan_change_points(s)
        assert point["build"] == "b9" and 1.01 < point["ratio"] < 1.03
