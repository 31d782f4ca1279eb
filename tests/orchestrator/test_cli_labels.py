"""Builds people can tell apart (issue 41): a build's label given, set, refused and resolved
(id, label, full name) wherever a build is named; tables and charts calling builds by label or
by the distinguishing end of their names, the full names listed once; shell completion of
builds, serials, alerts and schedules read from the store; numbers in human units. Through
CliRunner on a migrated store filled with the store's own functions."""

from __future__ import annotations

import json

import pytest

from agent.protocol import JobResult, Manifest, ManifestFile, Sample
from orchestrator import store
from orchestrator.cli import completion, numbers
from orchestrator.store.models import DeviceState, JobState

STAMP = "demo-20261129T012011Z"


def _manifest(name: str, created: float) -> Manifest:
    return Manifest(build=name, version="0.1.0", created=created, files=[
        ManifestFile("engine/__init__.py", name.encode().hex()[:64].ljust(64, "a"), 10),
        ManifestFile("models/tiny/model_index.json", "b" * 64, 20)])


def _one_error(result, *fragments: str) -> None:
    assert result.exit_code == 3, result.output  # bad input
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    for fragment in fragments:
        assert fragment in result.output, result.output


def _split(out: str) -> tuple[list[list[str]], list[str]]:
    """A command's output off a terminal: its table's rows (tab-separated cells) and its other lines."""
    lines = [line for line in out.splitlines() if line.strip() and not line.startswith("# ")]
    return [line.split("\t") for line in lines if "\t" in line], [line for line in lines if "\t" not in line]


def _latency(session, device, build, step_ms: list[float], peak_bytes: float, started: float) -> None:
    job = store.create_job(session, "latency", {"model": "models/tiny", "precision": "fp32", "steps": 2},
                           device.id, build.id)
    store.transition_job(session, job.id, JobState.running, worker="w1@testhost")
    store.record_result(session, job.id, JobResult(
        job_id=f"job{job.id}-a1", kind="latency", status="succeeded", started_at=started, finished_at=started + 60,
        device="Adreno (TM) 740", engine={"profile": "adreno", "precision": "fp32", "height": 64, "width": 64},
        samples=[*(Sample("unet_step_ms", v, "ms", r) for r, v in enumerate(step_ms)),
                 *(Sample("e2e_ms", 10 * v, "ms", r) for r, v in enumerate(step_ms)),
                 *(Sample("peak_gpu_bytes", peak_bytes, "bytes", r) for r in range(len(step_ms)))]))
    store.transition_job(session, job.id, JobState.succeeded)


@pytest.fixture
def demo(cli):
    """The store a demo leaves: builds <stamp>-a (id 1) and <stamp>-b (id 2), no labels, on
    phone-1 and phone-2, each with a latency run of each build."""
    with cli.Session() as s, s.begin():
        phones = [store.upsert_device(s, f"phone-{i}", "adb", f"127.0.0.1:555{i}", host="testhost") for i in (1, 2)]
        for phone in phones:
            store.set_device_state(s, phone.id, DeviceState.available)
        a = store.create_build(s, _manifest(f"{STAMP}-a", 1_700_000_000.0))
        b = store.create_build(s, _manifest(f"{STAMP}-b", 1_700_100_000.0))
        for i, phone in enumerate(phones):
            _latency(s, phone, a, [10.0, 10.2, 10.1, 9.9, 10.0, 10.1], 9_348_304.0, 1_700_000_100.0 + i)
            _latency(s, phone, b, [10.0, 10.1, 10.2, 9.9, 10.0, 10.1], 9_348_304.0, 1_700_100_100.0 + i)
        cli.ids = (a.id, b.id)
    return cli


# ---- the store: labels and the resolver ---------------------------------------------------


def test_labels_are_checked_and_unique(demo):
    with demo.Session() as s, s.begin():
        a, b = (store.get_build(s, i) for i in demo.ids)
        store.label_build(s, a, "A")
        for bad, fragment in [("", "1-32"), ("x" * 33, "1-32"), ("has space", "no spaces"), ("123", "all digits"),
                              ("A", "taken"), (f"{STAMP}-a", "taken")]:
            with pytest.raises(store.StoreError, match=fragment):
                store.label_build(s, b, bad)
        store.label_build(s, a, "A")  # its own label again is no clash
        with pytest.raises(store.StoreError, match="label of build"):
            store.create_build(s, _manifest("A", 1_700_200_000.0))


@pytest.mark.parametrize("ref", ["1", 1, "A", f"{STAMP}-a", " A "])
def test_a_build_is_found_by_id_label_or_name(demo, ref):
    with demo.Session() as s, s.begin():
        store.label_build(s, store.get_build(s, demo.ids[0]), "A")
        assert store.resolve_build(s, ref).name == f"{STAMP}-a"
        assert store.get_build(s, ref).name == f"{STAMP}-a"


def test_labels_and_the_resolver_on_both_stores(cli_db):
    """The label's uniqueness, free_label's prefix match and the resolver, in SQL: SQLite and PostgreSQL."""
    with cli_db.Session() as s, s.begin():
        a = store.create_build(s, _manifest(f"{STAMP}-a", 1_700_000_000.0), label="A")
        store.create_build(s, _manifest("A_b%", 1_700_100_000.0))  # LIKE's wildcards are plain text here
        assert store.create_build(s, _manifest(f"{STAMP}-a", 1_700_000_000.0), label="A") is a
        with pytest.raises(store.StoreError, match="taken"):
            store.create_build(s, _manifest("other", 1_700_200_000.0), label="A")
        assert store.free_label(s, "A") == "A2" and store.free_label(s, "A_b") == "A_b"
        assert store.free_label(s, "A_b%") == "A_b%2"  # the name is taken (a label could not hold %)
        assert [store.resolve_build(s, ref).id for ref in (str(a.id), "A", f"{STAMP}-a")] == [a.id] * 3
        assert store.build_display_names(s, [f"{STAMP}-a", "A_b%"]) == {f"{STAMP}-a": "A", "A_b%": "b%"}


def test_a_build_named_by_digits_is_never_taken_for_another_by_id(cli_db):
    """Build names may be all digits (a CI pipeline's number). "2" that is one build's id and
    another's name is refused naming both ids; `id:N` is always an id; a name of digits that is
    no id still finds its build."""
    with cli_db.Session() as s, s.begin():
        first = store.create_build(s, _manifest("first", 1_700_000_000.0))
        second = store.create_build(s, _manifest(str(first.id + 1), 1_700_100_000.0))  # named as the next id...
        third = store.create_build(s, _manifest(str(first.id), 1_700_200_000.0))  # ...and one named as first's id
        assert second.id == first.id + 1
        with pytest.raises(store.StoreError, match=rf"'{first.id}' is the id of build first and the name of build id "
                                                   rf"{third.id}; give {first.id} or {third.id} as `id:N`"):
            store.resolve_build(s, str(first.id))
        assert store.resolve_build(s, f"id:{first.id}") is first
        assert store.resolve_build(s, f"id:{third.id}") is third
        assert store.resolve_build(s, first.id) is first  # an int is an id
        # second is named as its own id: not ambiguous
        assert store.resolve_build(s, str(second.id)) is second


def test_an_unknown_build_says_what_was_tried(demo):
    with demo.Session() as s:
        with pytest.raises(store.StoreError, match=r"no build 'C' \(tried as a label and a name\)"):
            store.resolve_build(s, "C")
        with pytest.raises(store.StoreError, match=r"no build '9' \(tried as an id and a name\)"):
            store.resolve_build(s, "9")


def test_short_names_are_the_distinguishing_end():
    assert store.short_names([f"{STAMP}-a", f"{STAMP}-b"]) == ["a", "b"]
    assert store.short_names(["demo-X-a", "demo-Y-a", "demo-Y-b"]) == ["X-a", "Y-a", "b"]
    assert store.short_names(["run-1", "run-2"]) == ["run-1", "run-2"]  # never an id's digits
    assert store.short_names([f"{STAMP}-a", f"{STAMP}-b"], taken=["a"]) == ["20261129T012011Z-a", "b"]
    assert store.short_names([f"{STAMP}-a"]) == [f"{STAMP}-a"]  # alone: nothing to tell it from


def test_display_names_prefer_labels(demo):
    with demo.Session() as s, s.begin():
        store.label_build(s, store.get_build(s, demo.ids[1]), "B")
        assert store.build_display_names(s, [f"{STAMP}-a", f"{STAMP}-b", f"{STAMP}-a"]) == {
            f"{STAMP}-a": "a", f"{STAMP}-b": "B"}
        # an end that another build (not shown) is labelled or named would name that build
        store.create_build(s, _manifest("a", 1_700_200_000.0))
        assert store.build_display_names(s, [f"{STAMP}-a", f"{STAMP}-b"]) == {
            f"{STAMP}-a": "20261129T012011Z-a", f"{STAMP}-b": "B"}


def test_a_second_demo_labels_its_builds_a2_and_b2(demo):
    from orchestrator.cli.common import cli_settings
    from orchestrator.cli.demo import demo_labels

    assert demo_labels(cli_settings()) == ("A", "B")
    demo("builds", "label", "1", "A")
    demo("builds", "label", "2", "B")
    assert demo_labels(cli_settings()) == ("A2", "B2")
    with demo.Session() as s, s.begin():
        store.create_build(s, _manifest("A2", 1_700_200_000.0))  # a build named A2 takes that label too
        assert store.free_label(s, "A") == "A3"


# ---- farm builds --------------------------------------------------------------------------


def test_builds_label_sets_shows_and_clears(demo):
    out = demo("builds", "label", "1", "A").output
    assert f"build {STAMP}-a is now labelled A" in out
    rows, _ = _split(demo("builds", "list").output)
    assert [r[:3] for r in rows] == [["id", "label", "name"], ["2", "-", f"{STAMP}-b"], ["1", "A", f"{STAMP}-a"]]
    rows = json.loads(demo("builds", "list", "--json").output)
    assert [(r["id"], r["label"], r["display"]) for r in rows] == [(2, None, "b"), (1, "A", "A")]
    assert "label: A" in demo("builds", "show", "A").output
    _one_error(demo("builds", "label", "2", "A", ok=False), "build label 'A' is taken", "give another label")
    _one_error(demo("builds", "label", "2", "42", ok=False), "all digits")
    _one_error(demo("builds", "label", "2", ok=False), "give a LABEL, or --clear")
    assert "has no label now" in demo("builds", "label", "A", "--clear").output
    _one_error(demo("builds", "show", "A", ok=False), "no build 'A'")


def test_builds_create_takes_a_label_and_refuses_a_bad_or_taken_one_before_packing(demo, tiny_model_dir):
    _one_error(demo("builds", "create", "--model", str(tiny_model_dir), "--label", "two words", ok=False),
               "--label", "no spaces")
    demo("builds", "label", "1", "A")
    _one_error(demo("builds", "create", "--model", str(tiny_model_dir), "--label", "A", ok=False),
               "build label 'A' is taken")
    builds_dir = demo.tmp / "data" / "builds"
    assert not builds_dir.exists() or not list(builds_dir.iterdir())  # nothing packed for a refused label
    made = demo("builds", "create", "--model", str(tiny_model_dir), "--name", "rc-1", "--label", "rc1").output
    assert "created build rc-1 labelled rc1" in made, made
    assert json.loads(demo("builds", "show", "rc1", "--json").output)["name"] == "rc-1"


# ---- builds named in commands -------------------------------------------------------------


def test_results_take_a_build_by_id_label_or_name(demo):
    demo("builds", "label", "2", "B")
    for ref in ("2", "B", f"{STAMP}-b"):
        rows = json.loads(demo("results", "list", "--build", ref, "--json").output)
        assert {r["build"] for r in rows} == {f"{STAMP}-b"}, ref
    _one_error(demo("results", "list", "--build", "C", ok=False), "no build 'C'", "tried as a label and a name")


def test_check_takes_a_build_by_id(demo, monkeypatch):
    """`farm check --build 1` (its help says name or id) finds build 1, and a label names the
    baseline; the check stops where it would launch its first round."""
    from orchestrator.services import check as gate

    def launch(app, name, jobs, *, build, devices, **kwargs):
        raise gate.CheckFailed(f"would launch {build} against {jobs[0].get('build')}")

    monkeypatch.setattr(gate, "launch_suite", launch)
    demo("builds", "label", "1", "A")
    with demo.Session() as s:
        ids = {b.name: b.id for b in (store.get_build(s, f"{STAMP}-a"), store.get_build(s, f"{STAMP}-b"))}
    # the check hands its suites the builds' ids, never a name that could read as another's id
    result = demo("check", "--build", "2", "--baseline", "A", "--all", ok=False)
    assert f"would launch {ids[STAMP + '-b']} against {ids[STAMP + '-a']}" in result.output, result.output
    result = demo("check", "--build", "1", "--baseline", "1", "--all", ok=False)
    assert "no build '1'" not in result.output and f"would launch {ids[STAMP + '-a']} against" in result.output, \
        result.output


def test_deploy_takes_a_build_by_label(demo):
    demo("builds", "label", "1", "A")
    result = demo("deploy", "A", "--all", ok=False)
    assert "no build" not in result.output, result.output
    assert f"{STAMP}-a" in result.output  # the bundle it looked for is build A's


# ---- tables -------------------------------------------------------------------------------


def test_results_list_shows_distinguishing_ends_and_full_names_once(demo):
    rows, rest = _split(demo("results", "list").output)
    build = rows[0].index("build")
    assert [r[build] for r in rows[1:]] == ["b", "a", "b", "a"]
    assert not any(STAMP in cell for r in rows for cell in r)  # no name, whole or cut, in the table
    assert rest == [f"b = {STAMP}-b", f"a = {STAMP}-a"]
    demo("builds", "label", "1", "A")
    demo("builds", "label", "2", "B")
    rows, rest = _split(demo("results", "list").output)
    assert [r[build] for r in rows[1:]] == ["B", "A", "B", "A"]
    assert rest == [f"B = {STAMP}-b", f"A = {STAMP}-a"]


def test_results_show_names_the_build_by_label_and_name(demo):
    demo("builds", "label", "1", "A")
    assert f"build\tA = {STAMP}-a" in demo("results", "show", "1").output
    assert json.loads(demo("results", "show", "1", "--json").output)["build_label"] == "A"


def test_jobs_list_shows_labels_and_full_names_once(demo):
    demo("builds", "label", "2", "B")
    rows, rest = _split(demo("jobs", "list").output)
    build = rows[0].index("build")
    assert [r[build] for r in rows[1:]] == ["B", "a", "B", "a"]
    assert rest == [f"B = {STAMP}-b", f"a = {STAMP}-a"]


def test_a_check_report_names_builds_by_label_with_units(capsys):
    from orchestrator.cli.check import _print

    comparison = {"device": "phone-1", "metric": "peak_gpu_bytes", "baseline_build": f"{STAMP}-a",
                  "baseline_median": 9_348_304.0, "candidate_median": 9_348_304.0, "ratio": 1.0, "ci_low": 0.99,
                  "ci_high": 1.01, "verdict": "same", "rounds": 1}
    _print({"candidate": f"{STAMP}-b", "outcome": "no regression", "exit_code": 0, "fidelity": [],
            "comparisons": [comparison], "display": {f"{STAMP}-b": "B", f"{STAMP}-a": "A"}})
    rows, rest = _split(capsys.readouterr().out)
    assert rows[1][:7] == ["phone-1", "peak_gpu_bytes", "A", "8.92 MiB", "8.92 MiB", "1.000", "0.990-1.010"]
    assert rest[:2] == [f"B = {STAMP}-b", f"A = {STAMP}-a"]


def test_compare_names_builds_short_and_numbers_in_human_units(demo):
    demo("builds", "label", "1", "A")
    out = demo("results", "compare", "--build", "1", "--build", f"{STAMP}-b").output
    rows, rest = _split(out)
    assert out.startswith("# b against A"), out
    assert rows[0] == ["device", "metric", "A", "b", "ratio", "change", "95% CI", "p", "verdict"]
    by_metric = {r[1]: r for r in rows[1:] if r[0] == "phone-1"}
    assert by_metric["peak_gpu_bytes"][2:6] == ["8.92 MiB (n=6)", "8.92 MiB (n=6)", "1.000", "0.0%"]
    assert by_metric["unet_step_ms"][2].endswith(" ms (n=6)")
    assert "-0" not in out and "9,348,304" not in out, out
    for r in rows[1:]:
        assert r[7] == "-" or r[7] == "<0.001" or len(r[7]) == 5, r  # p as 0.xyz
    assert rest == [f"A = {STAMP}-a", f"b = {STAMP}-b"]


# ---- numbers ------------------------------------------------------------------------------


def test_numbers_read_as_people_write_them():
    assert numbers.byte_size(9_348_304.0) == "8.92 MiB"
    assert numbers.byte_size(3 * 2**30) == "3.00 GiB"
    assert numbers.byte_size(512) == "512 B"
    assert numbers.ms(12.3456) == "12.35 ms" and numbers.ms(1234.5) == "1,234 ms" and numbers.ms(0.12345) == "0.123 ms"
    assert numbers.metric_value("peak_gpu_bytes", 2**20) == "1.00 MiB"
    assert numbers.metric_value("unet_step_ms", 101.26) == "101.3 ms"
    assert numbers.ratio(1.0523456789012345) == "1.052"
    assert numbers.change(0.99999) == "0.0%" and numbers.change(1.0523) == "+5.2%" and numbers.change(0.97) == "-3.0%"
    assert numbers.p_value(0.00001) == "<0.001" and numbers.p_value(0.04213) == "0.042"
    assert numbers.plain(-0.0001) == "0" and numbers.plain(None) == "-"


# ---- completion ---------------------------------------------------------------------------


def test_completion_reads_the_store(demo):
    demo("builds", "label", "1", "A")
    with demo.Session() as s, s.begin():
        store.create_schedule(s, "nightly", "0 2 * * *", "UTC", {"build": None, "devices": "all", "jobs": []})
    values = [v for v, _ in completion.builds("")]
    assert values[:1] == ["A"] and {f"{STAMP}-a", f"{STAMP}-b", "1", "2"} <= set(values)
    assert [v for v, _ in completion.builds("demo-")] == [f"{STAMP}-b", f"{STAMP}-a"]
    assert [v for v, _ in completion.devices("phone-")] == ["phone-1", "phone-2"]
    assert [v for v, _ in completion.schedules("n")] == ["nightly"]
    assert completion.alerts("") == []


def _completions(demo, line: str) -> list[str]:
    """What bash's Tab after `line` offers (Click's completion protocol, through CliRunner)."""
    from typer.testing import CliRunner

    from orchestrator.cli import app

    words = line.split(" ")
    result = CliRunner().invoke(app, [], prog_name="farm", env={
        "_FARM_COMPLETE": "complete_bash", "COMP_WORDS": line, "COMP_CWORD": str(len(words) - 1)})
    assert result.exit_code == 0, result.output
    return result.output.split()


def test_commands_complete_builds_serials_alerts_and_schedules(demo):
    from orchestrator.store.models import Alert

    demo("builds", "label", "1", "A")
    with demo.Session() as s, s.begin():
        store.create_schedule(s, "nightly", "0 2 * * *", "UTC", {"build": None, "devices": "all", "jobs": []})
        phone = store.get_device(s, "phone-1")
        alert = store.save_alert(s, Alert(kind="regression", device_id=phone.id, build_id=demo.ids[1], metric="e2e_ms",
                                          series={}, detail={}, summary="slower"))
        alert_id = alert.id
    assert _completions(demo, "farm deploy ")[:1] == ["A"]
    assert _completions(demo, "farm deploy de") == [f"{STAMP}-b", f"{STAMP}-a"]
    assert _completions(demo, "farm check --build A") == ["A"]
    assert _completions(demo, "farm results compare --build 1 --build ") [:1] == ["A"]
    assert _completions(demo, "farm jobs submit latency --device ph") == ["phone-1", "phone-2"]
    assert _completions(demo, "farm results list --device phone-2") == ["phone-2"]
    assert _completions(demo, "farm regressions show ") == [str(alert_id)]
    assert _completions(demo, "farm schedules run-now n") == ["nightly"]
    assert _completions(demo, "farm builds label ")[:1] == ["A"]
    assert _completions(demo, "farm devices show phone-") == ["phone-1", "phone-2"]


def test_completion_without_a_store_suggests_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("FARM_DATA_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("FARM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("FARM_DATABASE_URL", f"sqlite:///{tmp_path / 'none' / 'farm.db'}")
    assert completion.builds("") == [] and completion.devices("") == []
    assert not (tmp_path / "none" / "farm.db").exists()  # looking made no store
    monkeypatch.setenv("FARM_DATABASE_URL", "postgresql+psycopg://nobody@127.0.0.1:1/none")
    assert completion.schedules("") == [] and completion.alerts("") == []


# ---- the API ------------------------------------------------------------------------------


@pytest.fixture
def api(demo):
    """The farm API over the demo store, with a read token."""
    from fastapi.testclient import TestClient

    from orchestrator.analysis import series_state
    from orchestrator.api import tokens
    from orchestrator.api.app import create_app
    from orchestrator.infra.settings import Settings

    with demo.Session() as s, s.begin():
        token = tokens.create_token(s, "read", "read")[1]
        series_state.catch_up(s, thorough=True)
    settings = Settings(data_dir=demo.tmp / "data", config_dir=demo.tmp / "config", host_name="testhost",
                        database_url=f"sqlite:///{demo.tmp / 'farm.db'}")
    with TestClient(create_app(settings), raise_server_exceptions=False,
                    headers={"Authorization": f"Bearer {token}"}) as client:
        yield client


def test_api_builds_carry_label_and_display_and_take_any_ref(demo, api):
    demo("builds", "label", "1", "A")
    builds = api.get("/v1/builds").json()
    assert [(b["id"], b["label"], b["display"]) for b in builds] == [(2, None, "b"), (1, "A", "A")]
    for ref in ("1", "A", f"{STAMP}-a"):
        shown = api.get(f"/v1/builds/{ref}").json()
        assert (shown["name"], shown["label"]) == (f"{STAMP}-a", "A"), ref
    missing = api.get("/v1/builds/C")
    assert missing.status_code == 404 and "tried as a label and a name" in missing.text
    for ref in ("2", f"{STAMP}-b"):
        assert {r["build"] for r in api.get("/v1/results", params={"build": ref}).json()} == {f"{STAMP}-b"}
    assert {r["build"] for r in api.get("/v1/results", params={"build": "A"}).json()} == {f"{STAMP}-a"}


def test_api_series_points_carry_what_charts_call_their_builds(demo, api):
    demo("builds", "label", "2", "B")
    (series, *_) = api.get("/v1/series", params={"device": "phone-1", "metric": "unet_step_ms"}).json()
    points = api.get(f"/v1/series/{series['id']}").json()["points"]
    assert [(p["build"], p["display"]) for p in points] == [(f"{STAMP}-a", "a"), (f"{STAMP}-b", "B")]


# ---- the dashboard's charts ---------------------------------------------------------------


def test_chart_axes_call_builds_as_the_store_does():
    """charts.js's shortNames (the x axis of a series' trend and kernel charts, where the API
    gave no `display`) against the store's short_names, on the demo's names and others; a
    given `display` (a label) wins."""
    import shutil
    import subprocess
    from pathlib import Path

    cases = [[f"{STAMP}-a", f"{STAMP}-b"], ["b1", "b2", "b3"], ["demo-X-a", "demo-Y-a", "demo-Y-b"],
             ["run-1", "run-2"], [f"{STAMP}-a"], ["tiny-0.1.0-20261129T012011Z", "tiny-0.1.0-20261130T012011Z"],
             ["a", "x-a", "y.b+c"]]
    charts = Path(store.__file__).parents[1] / "dashboard" / "static" / "charts.js"
    script = (f"global.window = {{farm: {{el() {{}}, fmt: {{}}}}}}; require({json.dumps(str(charts))}); "
              f"const c = window.farm.chart; console.log(JSON.stringify([{json.dumps(cases)}.map(c.shortNames), "
              f"c.axisNames({json.dumps(cases[0])}, ['A', undefined])]));")
    node = shutil.which("node")
    assert node, "node runs the dashboard's chart code here: bash scripts/ensure-grafana-schema.sh installs it"
    derived, given = json.loads(subprocess.run([node, "-e", script], capture_output=True, text=True, check=True,
                                               timeout=30).stdout)
    assert derived == [store.short_names(names) for names in cases]
    assert given == ["A", "b"]
