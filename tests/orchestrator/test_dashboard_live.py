"""The dashboard (orchestrator/dashboard, its JSON under /v1 in orchestrator/api/routes/
dashboard.py) in headless Chromium (Debian's chromium and chromedriver through selenium;
scripts/ensure-chromium.sh installs them; missing, the tests skip locally and fail in CI).

The store is seeded the farm's way and analysed for real: two local devices, builds b1 and b2
at 100 ms a UNet step and b3 30 % slower, each build's latency jobs recorded as results (UNet
step, end-to-end, peak GPU memory, kernel timings), a generate job per build on p1 whose single
end-to-end run (15 s) and image are not the latency series', and b3's batch analysed (the
regression alerts). Then, served by `farm api serve`'s app on uvicorn:

- the overview asks for a token, and with a read token shows every device x metric series'
  latest median and verdict as the analysis has them (series_history's medians, the alert on
  b3), and the open alerts;
- a series page charts that series only: per-build medians, lowest and highest equal the
  analysis', the generate job's 15 s is nowhere, b3's deploy is an annotation, the alert marker
  leads to the alert page;
- an alert page shows the alert's ratio, interval and the medians before and after as the
  analysis recorded them, the kernel attribution as bars, and both builds' images;
- Acknowledge with a read token shows the 403 and changes nothing; with a triage token the
  store's alert is acknowledged and the page says so;
- `farm dashboard build` writes the same pages with their JSON, which show the same numbers
  from file:// in a browser not allowed to fetch files;
- no page logs a console error (the console check is shown to see one)."""

from __future__ import annotations

import datetime as dt
import fnmatch
import os
import shutil
import statistics
import struct
import tomllib
import zlib
from pathlib import Path

import numpy as np
import pytest
from asgi_server import serving
from ci_support import missing
from sqlalchemy import select
from support import record_job, seed_nightlies
from typer.testing import CliRunner

from agent.protocol import Artifact, JobResult, KernelTiming, Sample
from orchestrator import store
from orchestrator.analysis import regressions
from orchestrator.api import tokens
from orchestrator.api.app import create_app
from orchestrator.dashboard import pages
from orchestrator.infra.settings import Settings
from orchestrator.jobs import batch_analysis
from orchestrator.jobs.celery_app import make_celery
from orchestrator.store import make_engine, make_session_factory, upgrade
from orchestrator.store.models import (
    Alert,
    AlertKind,
    AlertState,
    Build,
    Deployment,
    DeploymentStatus,
    Device,
    Job,
    Run,
)
from orchestrator.store.models import KernelTiming as KernelTimingRow

REPO = Path(__file__).resolve().parents[2]
SPEC = {"model": "models/tiny", "precision": "fp32", "steps": 2, "prompt": "a red bicycle", "seed": 0}
SPEC_KEY = regressions.SpecKey.of(SPEC)
METRICS = ("unet_step_ms", "e2e_ms", "peak_gpu_bytes")
GENERATE_E2E_MS = 15_000.0  # the generate job's one end-to-end run: never a latency sample
PEAK = 1.4 * 2**30
WAIT_S = 20


def _png(path: Path, rgb: tuple[int, int, int], size: int = 24) -> None:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes(rgb) * size for _ in range(size))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _latency(rng, slow: float) -> JobResult:
    steps = 100.0 * slow * rng.lognormal(0.0, 0.02, 10)
    e2e = 2000.0 * slow * rng.lognormal(0.0, 0.02, 6)
    kernels = [KernelTiming(k, 8, ms * (slow if k == "attention" else 1.0) * rng.lognormal(0.0, 0.01), r)
               for r in range(10) for k, ms in (("attention", 40.0), ("conv2d", 30.0), ("groupnorm", 5.0))]
    return JobResult(job_id="j", kind="latency", status="succeeded", kernel_timings=kernels,
                     samples=[Sample("unet_step_ms", float(v), "ms", r) for r, v in enumerate(steps)]
                     + [Sample("e2e_ms", float(v), "ms", r) for r, v in enumerate(e2e)]
                     + [Sample("peak_gpu_bytes", PEAK * (1 + 0.001 * i), "bytes", i) for i in range(3)])


def _generate(build: str) -> JobResult:
    return JobResult(job_id="g", kind="generate", status="succeeded",
                     samples=[Sample("e2e_ms", GENERATE_E2E_MS, "ms", 0)],
                     artifacts=[Artifact(f"{build}.png", "c" * 64, 100, kind="image")])


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    """The seeded, analysed SQLite store; its settings; a read and a triage token; the alerts."""
    root = tmp_path_factory.mktemp("farm")
    url = f"sqlite:///{root / 'farm.db'}"
    settings = Settings(data_dir=root / "data", config_dir=root / "config", host_name="h", database_url=url)
    upgrade(url)
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    rng = np.random.default_rng(20261130)
    images = root / "data" / "images"
    with sessions() as s, s.begin():
        devices = [store.upsert_device(s, serial, "local", f"/tmp/{serial}", host="h") for serial in ("p1", "p2")]
        for device in devices:
            store.set_device_state(s, device.id, "available")
        store.set_device_state(s, devices[0].id, "quarantined", "flaky USB hub", force=True)  # a state history
        store.set_device_state(s, devices[0].id, "available", "hub replaced", force=True)

        def with_an_image(build, batch):  # and b3 deployed to p1 at 02:05
            _png(images / f"{build.name}.png", (40 * int(build.name[1:]), 120, 200))
            record_job(s, "generate", SPEC, devices[0].id, build.id, _generate(build.name), batch_id=batch.id,
                       artifacts_dir=images)
            if build.name == "b3":
                s.add(Deployment(build_id=build.id, device_id=devices[0].id, status=DeploymentStatus.succeeded,
                                 finished_at=dt.datetime(2026, 11, 28, 2, 5, tzinfo=dt.UTC)))

        b3_batch = seed_nightlies(s, devices, SPEC, lambda slow: _latency(rng, slow), on_build=with_an_image)["b3"]
        made = {scope: tokens.create_token(s, scope, f"{scope} token")[1] for scope in ("read", "triage")}
    batch_analysis.analyze(make_celery(settings), b3_batch)
    with sessions() as s:
        alerts = {(a.device.serial, a.metric): a.id for a in s.scalars(select(Alert).where(
            Alert.kind == AlertKind.regression))}
    assert {("p1", "unet_step_ms"), ("p2", "unet_step_ms")} <= set(alerts), alerts
    yield {"settings": settings, "sessions": sessions, "tokens": made, "alerts": alerts, "url": url, "root": root}
    engine.dispose()



@pytest.fixture(scope="module")
def server(farm):
    """`farm api serve`'s app on uvicorn, on a free port; yields its base URL."""
    with serving(create_app(farm["settings"])) as base:
        yield base


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through selenium, console log kept. Not allowed file access from
    file:// pages: the offline copy must work as a user's browser opens it."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        missing("no chromium/chromedriver: bash scripts/ensure-chromium.sh installs them", "CI needs them")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1600"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


# ---- what the analysis says ------------------------------------------------------------------


def _history(farm, serial: str, metric: str) -> list[dict]:
    """The analysis' own per-build samples of the series (what its comparisons read)."""
    with farm["sessions"]() as s:
        device = store.get_device(s, serial)
        run = s.scalar(select(Run).where(Run.device_id == device.id).limit(1))
        environment = regressions.env_key_of(run, device)
        return regressions.series_history(s, device, SPEC_KEY, metric, environment=environment)


def _medians(history: list[dict]) -> dict[str, float]:
    return {h["build"]: statistics.median(h["values"]) for h in history}


# ---- the browser -----------------------------------------------------------------------------


def _severe(driver) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def _ready(driver) -> None:
    """Wait until the page's loader ended; fail with what #status says when it did not load."""
    from selenium.webdriver.support.ui import WebDriverWait

    state = WebDriverWait(driver, WAIT_S).until(
        lambda d: d.execute_script("const s = document.getElementById('status');"
                                   "return s && s.dataset.state !== 'loading' ? s.dataset.state : null;"))
    status = driver.execute_script("return document.getElementById('status').textContent")
    assert state == "ready", f"the page ended {state}: {status}"


def _value(element) -> float:
    return float(element.find_element("css selector", "[data-value]").get_attribute("data-value"))


def _artifact(driver, name: str) -> None:
    if os.environ.get("FARM_TEST_ARTIFACTS"):
        target = Path(os.environ["FARM_TEST_ARTIFACTS"])
        target.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(target / name))


def _sign_in(driver, base: str, token: str) -> None:
    """Open the overview, which asks for a token, and give it `token`."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get_log("browser")  # from here on, this test's console only
    driver.get(base + "/")
    driver.execute_script("localStorage.clear()")
    driver.get(base + "/")
    WebDriverWait(driver, WAIT_S).until(lambda d: d.find_element(By.ID, "token-form").is_displayed())
    assert "Enter an API token" in driver.find_element(By.ID, "token-message").text
    driver.find_element(By.ID, "token-input").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
    _ready(driver)


# ---- the live pages --------------------------------------------------------------------------


def _overview_checks(browser, farm) -> None:
    """What the overview must show, live or offline: each device x metric cell's latest median
    and verdict as the analysis has them, and the open alerts."""
    from selenium.webdriver.common.by import By

    with farm["sessions"]() as s:
        open_alerts = {a.id: str(a.state) for a in s.scalars(select(Alert).where(
            Alert.state.in_(regressions.OPEN_STATES)))}
    for serial in ("p1", "p2"):
        for metric in METRICS:
            cell = browser.find_element(By.CSS_SELECTOR, f'td.metric-cell[data-device="{serial}"][data-metric="{metric}"]')
            links = cell.find_elements(By.CSS_SELECTOR, "a.cell")
            assert len(links) == 1, (serial, metric, cell.text)  # one series: the generate job's run is not one
            history = _history(farm, serial, metric)
            assert [h["build"] for h in history] == ["b1", "b2", "b3"]
            assert _value(links[0]) == statistics.median(history[-1]["values"]), (serial, metric)
            alert_id = farm["alerts"].get((serial, metric))
            verdict = links[0].find_elements(By.CSS_SELECTOR, ".verdict")
            if alert_id is not None:
                assert verdict and verdict[0].get_attribute("data-alert-id") == str(alert_id)
                assert verdict[0].get_attribute("data-state") == open_alerts.get(alert_id, verdict[0].get_attribute(
                    "data-state"))
    p1_e2e = browser.find_element(By.CSS_SELECTOR, 'td.metric-cell[data-device="p1"][data-metric="e2e_ms"] a.cell')
    assert "ms" in p1_e2e.text and _value(p1_e2e) < 5000 < GENERATE_E2E_MS
    peak = browser.find_element(By.CSS_SELECTOR, 'td.metric-cell[data-device="p1"][data-metric="peak_gpu_bytes"] '
                                                 ".latest").text
    assert peak.endswith(" GiB") and peak.startswith("1.4"), peak
    # a row per alert group, each alert of it in a row under it (shown when the group is opened)
    listed = {int(r.get_attribute("data-alert-id")): r.get_attribute("data-state")
              for r in browser.find_elements(By.CSS_SELECTOR, "#open-alerts tbody tr[data-alert-id]")}
    assert {a for a, state in listed.items() if state in ("new", "acknowledged")} == set(open_alerts)
    _group_rows_checks(browser, farm)


def _groups(farm) -> dict[int, list[int]]:
    """{group id: its alerts' ids} of the groups with an open alert, as the store has them."""
    with farm["sessions"]() as s:
        return {view.group.id: [a.id for a in view.alerts] for view in store.list_alert_groups(s)}


def _group_rows_checks(browser, farm) -> None:
    """One row per open group, with its alert count, builds and devices x metrics; its alerts'
    rows name the group."""
    from selenium.webdriver.common.by import By

    groups = _groups(farm)
    rows = browser.find_elements(By.CSS_SELECTOR, "#open-alerts tr.group-row")
    assert {int(r.get_attribute("data-group-id")) for r in rows} == set(groups)
    for row in rows:
        group_id = int(row.get_attribute("data-group-id"))
        count = row.find_element(By.CSS_SELECTOR, ".group-count")
        assert int(count.get_attribute("data-count")) == int(count.text) == len(groups[group_id])
        assert sorted(int(r.get_attribute("data-alert-id")) for r in browser.find_elements(
            By.CSS_SELECTOR, f'#open-alerts tr.group-alert[data-group-id="{group_id}"]')) == groups[group_id]
    with farm["sessions"]() as s:
        view = store.get_alert_group(s, int(rows[0].get_attribute("data-group-id")))
        devices, metrics = len(view.devices), len(view.metrics)
    assert rows[0].find_element(By.CSS_SELECTOR, ".builds").text == "b2 → b3"
    assert rows[0].find_element(By.CSS_SELECTOR, ".cells").text == f"{devices} devices × {metrics} metrics"
    assert devices == 2 and metrics >= 2


def _open_group_of(browser, alert_id: int) -> None:
    """Open the group row the alert is listed under (its row is hidden until then)."""
    from selenium.webdriver.common.by import By

    group_id = browser.find_element(By.CSS_SELECTOR, f'#open-alerts tr[data-alert-id="{alert_id}"]').get_attribute(
        "data-group-id")
    _open_group(browser, group_id)


def _open_group(browser, group_id) -> None:
    """Open a group's row (its alerts, owner, bug link and note show) unless it is open."""
    from selenium.webdriver.common.by import By

    row = browser.find_element(By.CSS_SELECTOR, f'#open-alerts tr.group-row[data-group-id="{group_id}"]')
    if row.get_attribute("data-open") != "true":
        row.find_element(By.CSS_SELECTOR, "button.expand").click()


def test_the_overview_asks_for_a_token_then_shows_the_analysis_numbers(farm, server, browser):
    from selenium.webdriver.common.by import By

    _sign_in(browser, server, farm["tokens"]["read"])
    assert browser.title == "devicefarm overview"
    _overview_checks(browser, farm)
    regression = browser.find_element(By.CSS_SELECTOR, 'td.metric-cell[data-device="p1"][data-metric="unet_step_ms"] '
                                                       "a.cell")
    with farm["sessions"]() as s:
        ratio = s.get(Alert, farm["alerts"][("p1", "unet_step_ms")]).ratio
    assert 1.2 < ratio < 1.4 and f"regression new +{(ratio - 1) * 100:.1f} %" in regression.text
    # the build by what people call it (its label, else the end of its name), the full name on hover
    build = regression.find_element(By.CSS_SELECTOR, ".muted")
    assert build.text.startswith("build b3, n=") and build.get_attribute("title") == "b3"
    assert _severe(browser) == []
    _artifact(browser, "dashboard-live-overview.png")


def _series_id(farm, serial: str, metric: str) -> str:
    from orchestrator.analysis import series as farm_series

    with farm["sessions"]() as s:
        (found,) = farm_series.list_series(s, store.get_device(s, serial), metric)
        return found.id


def _series_checks(browser, farm, serial: str, metric: str) -> None:
    """A series page: its key, and per build the median, lowest and highest sample of the
    analysis' own history, in the table and in what the chart plots; the alert marker."""
    from selenium.webdriver.common.by import By

    history = _history(farm, serial, metric)
    medians = _medians(history)
    title = browser.find_element(By.ID, "series-title").text
    assert title.startswith(f"{metric} on {serial}: models/tiny native, 2 steps, fp32")
    key = {r.find_element(By.TAG_NAME, "th").text: r.find_element(By.TAG_NAME, "td").text
           for r in browser.find_elements(By.CSS_SELECTOR, "#series-key tbody tr")}
    assert (key["job kind"], key["model"], key["steps"], key["precision"], key["profile"]) == (
        "latency", "models/tiny", "2", "fp32", "auto")
    rows = browser.find_elements(By.CSS_SELECTOR, "#points tbody tr")
    assert [r.get_attribute("data-build") for r in rows] == ["b1", "b2", "b3"]
    for row, h in zip(rows, history, strict=True):
        assert _value(row.find_element(By.CSS_SELECTOR, "td.median")) == medians[h["build"]]
        assert _value(row.find_element(By.CSS_SELECTOR, "td.min")) == min(h["values"])
        assert _value(row.find_element(By.CSS_SELECTOR, "td.max")) == max(h["values"])
    plotted = browser.execute_script("const c = farm.charts.trend; return [c.data[1], c.data[2], c.data[3], "
                                     "c.root.querySelector('.u-title').textContent];")
    scale = 2**30 if metric.endswith("_bytes") else 1
    assert plotted[0] == pytest.approx([medians[b] / scale for b in ("b1", "b2", "b3")], rel=1e-12)
    assert plotted[1] == pytest.approx([min(h["values"]) / scale for h in history], rel=1e-12)
    assert plotted[2] == pytest.approx([max(h["values"]) / scale for h in history], rel=1e-12)
    assert plotted[3] == title
    canvas = browser.find_element(By.CSS_SELECTOR, "#trend canvas")
    assert canvas.size["width"] > 400 and canvas.size["height"] > 200
    alert_id = farm["alerts"].get((serial, metric))
    markers = browser.find_elements(By.CSS_SELECTOR, "#trend a.alert-marker")
    if alert_id is not None:
        assert [(m.get_attribute("data-alert-id"), m.get_attribute("data-build")) for m in markers] == [
            (str(alert_id), "b3")]
    else:
        assert markers == []


def test_a_series_page_charts_that_series_only(farm, server, browser):
    """p1's end-to-end series: the latency suite's samples only (the generate job ran 15 s a
    build on p1 and is in none of them); its alert marker opens the alert's page."""
    from selenium.webdriver.common.by import By

    _sign_in(browser, server, farm["tokens"]["read"])
    browser.find_element(By.CSS_SELECTOR, 'td.metric-cell[data-device="p1"][data-metric="e2e_ms"] a.cell').click()
    _ready(browser)
    assert browser.current_url == f"{server}/series/{_series_id(farm, 'p1', 'e2e_ms')}"
    _series_checks(browser, farm, "p1", "e2e_ms")
    assert all(v < 5000 for h in _history(farm, "p1", "e2e_ms") for v in h["values"])
    maxima = [_value(c) for c in browser.find_elements(By.CSS_SELECTOR, "#points td.max")]
    assert max(maxima) < 5000 < GENERATE_E2E_MS
    deploys = browser.find_elements(By.CSS_SELECTOR, ".annotations li[data-kind=deploy]")
    assert [d.text for d in deploys] == ["b3: deployed 2026-11-28 02:05 UTC"]  # b3's deploy to p1, as recorded
    _artifact(browser, "dashboard-live-series.png")
    browser.find_element(By.CSS_SELECTOR, "#trend a.alert-marker").click()
    _ready(browser)
    assert browser.current_url == f"{server}/alerts/{farm['alerts'][('p1', 'e2e_ms')]}"
    # peak GPU memory: charted in GiB, the axis says so
    browser.get(f"{server}/series/{_series_id(farm, 'p2', 'peak_gpu_bytes')}")
    _ready(browser)
    _series_checks(browser, farm, "p2", "peak_gpu_bytes")
    assert browser.execute_script("return farm.charts.trend.axes[1].label") == "peak_gpu_bytes (GiB)"
    assert browser.find_element(By.CSS_SELECTOR, "#points td.median").text.endswith(" GiB")
    assert _severe(browser) == []


def _alert_checks(browser, farm, alert_id: int) -> None:
    """An alert page: the alert's ratio, interval and p as the analysis stored them, the
    medians and sample counts it compared, the samples of both builds in its series, the
    kernel attribution as bars, both builds' generated images, its series' trend."""
    from selenium.webdriver.common.by import By

    with farm["sessions"]() as s:
        alert = s.get(Alert, alert_id)
        ratio, ci, p, detail = alert.ratio, (alert.ci_low, alert.ci_high), alert.p_value, alert.detail
        serial, metric = alert.device.serial, alert.metric
    assert _value(browser.find_element(By.ID, "ratio")) == ratio
    assert (_value(browser.find_element(By.ID, "ci-low")), _value(browser.find_element(By.ID, "ci-high"))) == ci
    assert _value(browser.find_element(By.ID, "p-value")) == p
    assert browser.find_element(By.ID, "interval").text == f"[{ci[0]:.3f}, {ci[1]:.3f}]"
    history = {h["build"]: h["values"] for h in _history(farm, serial, metric)}
    for side, build, median, n in (("before", "b2", detail["baseline_median"], detail["n_baseline"]),
                                   ("after", "b3", detail["candidate_median"], detail["n_candidate"])):
        row = browser.find_element(By.ID, f"samples-{side}")
        assert row.get_attribute("data-build") == build
        assert _value(row.find_element(By.CSS_SELECTOR, "td.median")) == median
        assert median == statistics.median(history[build])  # what the analysis compared is the series' samples
        assert int(row.find_element(By.CSS_SELECTOR, "td.n").text) == n == len(history[build])
    bars = browser.execute_script("const c = farm.charts['attribution-chart']; return [c.data[1], "
                                  "c.root.querySelector('.u-title').textContent];")
    moved = [m for m in detail["attribution"] if m["delta_ms"] is not None]
    assert bars[0] == pytest.approx([m["delta_ms"] for m in moved], rel=1e-12) and bars[1].startswith("Change of")
    assert moved[0]["kernel"] == "attention"  # the analysis put the kernel that moved first
    rows = browser.find_elements(By.CSS_SELECTOR, "#attribution tbody tr")
    assert [r.get_attribute("data-kernel") for r in rows] == [m["kernel"] for m in moved]
    for side in ("before", "after"):
        image = browser.find_element(By.ID, f"image-{side}")
        assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) == 24
    assert browser.execute_script("return farm.charts.trend.data[1]") == pytest.approx(
        [statistics.median(history[b]) for b in ("b1", "b2", "b3")], rel=1e-12)


def test_an_alert_page_shows_what_the_analysis_found(farm, server, browser):
    from selenium.webdriver.common.by import By

    alert_id = farm["alerts"][("p1", "unet_step_ms")]
    _sign_in(browser, server, farm["tokens"]["read"])
    _open_group_of(browser, alert_id)
    browser.find_element(By.CSS_SELECTOR, f'#open-alerts tr[data-alert-id="{alert_id}"] a.alert-link').click()
    _ready(browser)
    assert browser.current_url == f"{server}/alerts/{alert_id}"
    _alert_checks(browser, farm, alert_id)
    assert browser.find_element(By.ID, "series-link").get_attribute("href") == (
        f"{server}/series/{_series_id(farm, 'p1', 'unet_step_ms')}")
    assert _severe(browser) == []
    _artifact(browser, "dashboard-live-alert.png")


def test_acknowledge_needs_a_triage_token(farm, server, browser):
    """A read token's triage buttons are disabled, saying why (they were enabled until the
    403), and the alert stays as it was; a triage token's acknowledges it in the store and the
    page shows its new state."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    alert_id = farm["alerts"][("p2", "unet_step_ms")]
    _sign_in(browser, server, farm["tokens"]["read"])
    browser.get(f"{server}/alerts/{alert_id}")
    _ready(browser)
    for action in ("acknowledge", "invalidate", "fixed"):
        button = browser.find_element(By.ID, f"triage-{action}")
        assert not button.is_enabled()
        assert "This token's scope (read) does not grant triage" in button.get_attribute("title")
        assert "farm api token create --scope triage" in button.get_attribute("title")
    assert "does not grant triage" in browser.find_element(By.ID, "triage-refusal").text
    assert browser.find_element(By.ID, "alert-state").text == "new"
    with farm["sessions"]() as s:
        alert = s.get(Alert, alert_id)
        assert alert.state == AlertState.new
        assert browser.find_element(By.ID, "alert-group").text == f"#{alert.group_id}"
    assert _severe(browser) == []

    browser.find_element(By.ID, "sign-out").click()
    browser.find_element(By.ID, "token-input").send_keys(farm["tokens"]["triage"])
    browser.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
    _ready(browser)  # the page is drawn again with the triage token
    message = browser.find_element(By.ID, "triage-message")
    browser.find_element(By.ID, "triage-note").send_keys("looking at attention")
    browser.find_element(By.ID, "triage-acknowledge").click()
    WebDriverWait(browser, WAIT_S).until(lambda d: message.get_attribute("data-kind") != "working")
    assert message.get_attribute("data-kind") == "done", message.text
    assert message.text == f"Alert #{alert_id} is now acknowledged."
    assert browser.find_element(By.ID, "alert-state").text == "acknowledged"
    assert browser.find_element(By.ID, "alert-note").text == "looking at attention"
    with farm["sessions"]() as s:
        alert = s.get(Alert, alert_id)
        assert (alert.state, alert.note) == (AlertState.acknowledged, "looking at attention")
    assert _severe(browser) == []


def test_a_refused_token_shows_the_form_again_with_why(farm, server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server + "/")
    browser.execute_script("localStorage.setItem('farm.api.token', 'farm_' + 'x'.repeat(43))")
    browser.get(f"{server}/series/{_series_id(farm, 'p1', 'unet_step_ms')}")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "token-form").is_displayed())
    assert browser.find_element(By.ID, "status").get_attribute("data-state") == "token"
    assert browser.find_element(By.ID, "token-message").text == (
        "The farm API refused the token (unknown or revoked token). Enter another.")
    browser.find_element(By.ID, "token-input").send_keys(farm["tokens"]["read"])
    browser.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
    _ready(browser)  # the same page loads with the new token
    _series_checks(browser, farm, "p1", "unet_step_ms")


def test_a_device_page_shows_its_health(farm, server, browser):
    from selenium.webdriver.common.by import By

    _sign_in(browser, server, farm["tokens"]["read"])
    browser.find_element(By.CSS_SELECTOR, '#grid tr[data-device="p1"] th a').click()
    _ready(browser)
    assert browser.current_url == f"{server}/devices/p1"
    assert browser.find_element(By.ID, "run-counts").text == "6 succeeded, 0 failed"  # 3 latency, 3 generate
    assert _value(browser.find_element(By.ID, "failure-rate")) == 0
    series = browser.find_elements(By.CSS_SELECTOR, "#device-series tbody tr")
    assert sorted(r.find_element(By.TAG_NAME, "a").text for r in series) == sorted(METRICS)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#recent-runs tbody tr")) == 6
    history = [[c.text for c in r.find_elements(By.TAG_NAME, "td")][1:]
               for r in browser.find_elements(By.CSS_SELECTOR, "#state-history tbody tr")]
    assert history == [["quarantined", "available", "release", "hub replaced"],  # newest first
                       ["available", "quarantined", "quarantine", "flaky USB hub"],
                       ["offline", "available", "answered", ""]]
    assert _severe(browser) == []


def test_a_reserved_device_is_marked_and_its_page_shows_the_reservation_and_newest_screenshot(farm, server, browser):
    import hashlib

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    shot = farm["settings"].data_dir / "screenshots" / "p1" / "newest.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    _png(shot, (10, 200, 30), size=24)
    with farm["sessions"]() as s, s.begin():
        device = store.get_device(s, "p1")
        store.reserve_device(s, device, "ana", store.utcnow() + dt.timedelta(hours=2), "camera bug")
        store.record_screenshot(s, device.id, "screenshots/p1/newest.png", hashlib.sha256(shot.read_bytes()).hexdigest(),
                                shot.stat().st_size, 24, 24, "adb")
    try:
        _sign_in(browser, server, farm["tokens"]["read"])
        mark = browser.find_element(By.CSS_SELECTOR, '#grid tr[data-device="p1"] th .reserved')
        assert mark.text == "reserved by ana" and mark.get_attribute("title").endswith("UTC (camera bug)")
        assert browser.find_elements(By.CSS_SELECTOR, '#grid tr[data-device="p2"] th .reserved') == []
        browser.get(f"{server}/devices/p1")
        _ready(browser)
        held = browser.find_element(By.ID, "reservation").text
        assert "reserved by ana until " in held and "(camera bug)" in held
        image = browser.find_element(By.CSS_SELECTOR, "img#screenshot")  # fetched with the token
        WebDriverWait(browser, WAIT_S).until(
            lambda d: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) == 24)
        assert _severe(browser) == []
    finally:
        with farm["sessions"]() as s, s.begin():
            store.release_reservation(s, store.get_device(s, "p1"))


# ---- the offline copy ------------------------------------------------------------------------


@pytest.fixture
def cli_env(farm, monkeypatch):
    monkeypatch.setenv("FARM_DATABASE_URL", farm["url"])
    monkeypatch.setenv("FARM_DATA_DIR", str(farm["settings"].data_dir))
    monkeypatch.setenv("FARM_CONFIG_DIR", str(farm["settings"].config_dir))
    monkeypatch.delenv("FARM_BROKER_URL", raising=False)


def test_the_offline_build_shows_the_same_numbers_from_file(farm, cli_env, browser, tmp_path):
    from selenium.webdriver.common.by import By

    from orchestrator.cli import app

    out = tmp_path / "site"
    result = CliRunner().invoke(app, ["dashboard", "build", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"dashboard written: {out / 'index.html'}" in " ".join(result.output.split())
    for page, name in pages.PAGES.items():  # the same pages the API serves, but for offline use
        assert (out / name).read_text() == pages.render(page, live=False)
    assert (out / "static" / "vendor" / "uplot" / "LICENSE").is_file()
    browser.get_log("browser")
    browser.get((out / "index.html").as_uri())
    _ready(browser)
    assert not browser.find_element(By.ID, "token-form").is_displayed()
    _overview_checks(browser, farm)
    buttons = browser.find_elements(By.CSS_SELECTOR, "#open-alerts button.group-action")
    assert buttons and all(not b.is_enabled() and "offline copy cannot triage" in b.get_attribute("title")
                           for b in buttons)
    _verdict_checks(browser, farm)  # the offline copy's verdicts: the same, as unsettled
    browser.find_element(By.CSS_SELECTOR, 'td.metric-cell[data-device="p2"][data-metric="e2e_ms"] a.cell').click()
    _ready(browser)
    _series_checks(browser, farm, "p2", "e2e_ms")
    alert_id = farm["alerts"][("p1", "unet_step_ms")]
    browser.get((out / "alert.html").as_uri() + f"?id={alert_id}")
    _ready(browser)
    _alert_checks(browser, farm, alert_id)
    assert not browser.find_element(By.ID, "triage-acknowledge").is_enabled()
    browser.get((out / "device.html").as_uri() + "?id=p2")
    _ready(browser)
    assert browser.find_element(By.ID, "run-counts").text == "3 succeeded, 0 failed"
    _device_checks(browser)
    browser.get((out / "gallery.html").as_uri() + "?id=b2")
    _ready(browser)
    _gallery_checks(browser, farm, "b2")
    assert _severe(browser) == []
    _artifact(browser, "dashboard-offline-device.png")


# ---- the command line and the package --------------------------------------------------------


def test_farm_dashboard_serve_runs_the_api_with_its_pages(farm, cli_env, monkeypatch):
    import uvicorn
    from fastapi.testclient import TestClient

    from orchestrator.cli import app

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda api, **kw: served.update(api=api, **kw))
    result = CliRunner().invoke(app, ["dashboard", "serve", "--port", "0"])
    assert result.exit_code == 0, result.output
    assert "http://127.0.0.1:0/" in result.output and "farm api token create --scope read" in result.output
    with TestClient(served["api"]) as client:
        page = client.get("/alerts/1")
        assert page.status_code == 200 and '<meta name="farm-mode" content="live">' in page.text
        assert client.get("/static/vendor/uplot/uPlot.iife.min.js").text.startswith(
            "/*! https://github.com/leeoniya/uPlot (v1.6.32) */")
        assert client.get("/v1/overview").status_code == 401  # the pages are open, their data is not
        token = {"Authorization": f"Bearer {farm['tokens']['read']}"}
        assert client.get("/v1/overview", headers=token).json()["devices"][0]["serial"] == "p1"


def test_farm_dashboard_build_on_an_unmigrated_store_is_one_error(tmp_path, monkeypatch):
    from orchestrator.cli import app

    monkeypatch.setenv("FARM_DATABASE_URL", f"sqlite:///{tmp_path / 'none.db'}")
    monkeypatch.setenv("FARM_DATA_DIR", str(tmp_path / "data"))
    result = CliRunner().invoke(app, ["dashboard", "build", "--out", str(tmp_path / "out")])
    assert result.exit_code == 4  # could not run: the store is not at the schema this code needs
    assert "error:" in result.output and "farm db upgrade" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out" / "index.html").exists()


def test_the_dashboard_files_ship_in_the_package():
    """Every file of the dashboard's static folder matches a package-data pattern."""
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "orchestrator.dashboard"]
    files = [p.relative_to(pages.STATIC.parent).as_posix() for p in pages.STATIC.rglob("*") if p.is_file()]
    assert len(files) >= 12
    assert [f for f in files if not any(fnmatch.fnmatch(f, pattern) and f.count("/") == pattern.count("/")
                                        for pattern in patterns)] == []


def test_the_console_check_sees_errors(browser, tmp_path):
    """What the tests above rely on: a page's script error is a SEVERE console entry."""
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><script>undefinedFunction()</script></body></html>")
    browser.get_log("browser")
    browser.get(page.as_uri())
    assert _severe(browser), "a script error did not show in the browser log"


def test_grafanas_alert_link_opens_the_alerts_page_here(farm, server, browser):
    """dashboards/alerts.json links an alert's number to ${farm_url}/alerts/<id>: with farm_url at
    this API, that URL is the alert's page (its ratio as the analysis stored it)."""
    import json


    board = json.loads((Path(__file__).resolve().parents[2] / "dashboards" / "alerts.json").read_text())
    (table,) = [p for p in board["panels"] if p["type"] == "table"]
    (link,) = [link for o in table["fieldConfig"]["overrides"] if o["matcher"]["options"] == "alert"
               for prop in o["properties"] if prop["id"] == "links" for link in prop["value"]]
    alert_id = farm["alerts"][("p1", "unet_step_ms")]
    url = link["url"].replace("${farm_url}", server).replace("${__value.raw}", str(alert_id))
    _sign_in(browser, server, farm["tokens"]["read"])
    browser.get(url)
    _ready(browser)
    _alert_checks(browser, farm, alert_id)
    assert _severe(browser) == []


def test_a_series_page_charts_its_kernels_over_builds(farm, server, browser):
    """The kernel trend of p1's UNet-step series: per build, each kernel's time in one timed
    repetition (calls summed) averaged over the repetitions of the series' runs, computed here
    from the stored kernel timings; the chart plots the same numbers, slowest kernel first;
    b3's attention kernel is the one that moved (30% slower in the seed)."""
    from selenium.webdriver.common.by import By

    with farm["sessions"]() as s:
        rows = s.execute(select(Build.name, KernelTimingRow.run_id, KernelTimingRow.repetition, KernelTimingRow.kernel,
                                KernelTimingRow.total_ms)
                         .join(Run, Run.id == KernelTimingRow.run_id).join(Build, Build.id == Run.build_id)
                         .join(Job, Job.id == Run.job_id).join(Device, Device.id == Run.device_id)
                         .where(Device.serial == "p1", Job.kind == "latency")).all()
    want: dict[str, dict[str, float]] = {}
    for build in ("b1", "b2", "b3"):
        mine = [r for r in rows if r.name == build]
        repetitions = {(r.run_id, r.repetition) for r in mine}
        for kernel in {r.kernel for r in mine}:
            want.setdefault(kernel, {})[build] = sum(r.total_ms for r in mine if r.kernel == kernel) / len(repetitions)
    _sign_in(browser, server, farm["tokens"]["read"])
    browser.get(f"{server}/series/{_series_id(farm, 'p1', 'unet_step_ms')}")
    _ready(browser)
    plotted = browser.execute_script("const c = farm.charts['kernel-trend']; "
                                     "return [c.series.slice(1).map((s) => s.label), c.data.slice(1)];")
    assert plotted[0] == ["attention", "conv2d", "groupnorm"]  # slowest in b3 first
    for kernel, values in zip(*plotted, strict=True):
        assert values == pytest.approx([want[kernel][b] for b in ("b1", "b2", "b3")], rel=1e-12)
    table = {r.get_attribute("data-kernel"): [_value(c) for c in r.find_elements(By.CSS_SELECTOR, "td.num")]
             for r in browser.find_elements(By.CSS_SELECTOR, "#kernels tbody tr")}
    assert table["attention"] == pytest.approx([want["attention"][b] for b in ("b1", "b2", "b3")], rel=1e-12)
    assert want["attention"]["b3"] / want["attention"]["b2"] > 1.2 > want["conv2d"]["b3"] / want["conv2d"]["b2"]
    assert _severe(browser) == []


def _gallery_checks(browser, farm, build: str) -> None:
    """A build's gallery: every image its generate jobs made (here one, p1's), loaded, with its
    device, job, workload and prompt."""
    from selenium.webdriver.common.by import By

    from orchestrator.store.models import Image

    with farm["sessions"]() as s:
        images = s.execute(select(Image.id, Image.prompt, Run.job_id).join(Run, Run.id == Image.run_id)
                           .join(Build, Build.id == Run.build_id).where(Build.name == build)).all()
    assert len(images) == 1
    assert browser.find_element(By.ID, "gallery-title").text == f"Images of build {build}"
    figures = browser.find_elements(By.CSS_SELECTOR, "#gallery figure")
    assert [f.get_attribute("data-image-id") for f in figures] == [str(images[0].id)]
    assert figures[0].get_attribute("data-device") == "p1"
    caption = figures[0].find_element(By.TAG_NAME, "figcaption").text
    assert f"p1, job {images[0].job_id}: models/tiny native 2 steps fp32 auto" in caption and images[0].prompt in caption
    img = figures[0].find_element(By.TAG_NAME, "img")
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) == 24


def test_a_builds_gallery_shows_the_images_its_generate_jobs_made(farm, server, browser):
    """From a series page's build link to that build's gallery."""
    from selenium.webdriver.common.by import By

    _sign_in(browser, server, farm["tokens"]["read"])
    browser.get(f"{server}/series/{_series_id(farm, 'p1', 'unet_step_ms')}")
    _ready(browser)
    browser.find_element(By.CSS_SELECTOR, '#points tr[data-build="b3"] a.build-link').click()
    _ready(browser)
    assert browser.current_url == f"{server}/builds/b3"
    _gallery_checks(browser, farm, "b3")
    browser.get(f"{server}/builds/b1")
    _ready(browser)
    _gallery_checks(browser, farm, "b1")
    assert _severe(browser) == []


# ---- verdicts, the device page's facts, the kernels that moved (issue 41) ---------------------


def _api(farm, path: str):
    from fastapi.testclient import TestClient

    with TestClient(create_app(farm["settings"])) as client:
        response = client.get(path, headers={"Authorization": f"Bearer {farm['tokens']['read']}"})
        assert response.status_code == 200, response.text
        return response.json()


GREEN = {"rgb(44, 160, 44)", "rgba(44, 160, 44, 1)"}  # .badge-ok, .verdict-improvement


def _verdict_checks(browser, farm) -> None:
    """Every overview cell shows its series' newest verdict as the API has it, by class and text;
    an unsettled one (p1's peak GPU memory: 3 samples a run, too few to decide) is not green, and
    no cell says "no alert" in green any more."""
    from selenium.webdriver.common.by import By

    cells = {(c["device"], c["metric"]): c["latest_verdict"] for c in _api(farm, "/v1/overview")["cells"]}
    assert cells[("p1", "peak_gpu_bytes")]["verdict"] == "inconclusive" and cells[("p1", "unet_step_ms")][
        "verdict"] == "regression"
    for (serial, metric), want in cells.items():
        badge = browser.find_element(By.CSS_SELECTOR, f'td.metric-cell[data-device="{serial}"][data-metric="{metric}"] '
                                                      ".series-verdict")
        assert badge.get_attribute("data-verdict") == want["verdict"]
        assert f"verdict-{want['verdict']}" in badge.get_attribute("class").split()
        label = want["verdict"].replace("_", " ")
        assert badge.text.endswith(label) and badge.text.startswith(f"{want['ratio']:.3f}x"), badge.text
        if want["ci_low"] is not None:
            assert f"({want['ci_low']:.3f}-{want['ci_high']:.3f})" in badge.text
        if not want["settled"]:
            assert badge.value_of_css_property("background-color") not in GREEN, (serial, metric)
    assert "no alert" not in browser.find_element(By.ID, "grid").text


def test_the_overview_shows_each_verdict_and_an_unsettled_one_is_not_green(farm, server, browser):
    _sign_in(browser, server, farm["tokens"]["read"])
    _verdict_checks(browser, farm)
    assert _severe(browser) == []


def _device_checks(browser) -> None:
    from selenium.webdriver.common.by import By

    content = browser.find_element(By.ID, "content").text
    assert "null" not in content.split() and "undefined" not in content, content


def test_a_device_page_shows_no_null_and_each_series_verdict(farm, server, browser):
    from selenium.webdriver.common.by import By

    _sign_in(browser, server, farm["tokens"]["read"])
    for serial in ("p1", "p2"):  # neither is quarantined now
        browser.get(f"{server}/devices/{serial}")
        _ready(browser)
        _device_checks(browser)
        cells = {c["series_id"]: c["latest_verdict"]["verdict"] for c in _api(farm, "/v1/overview")["cells"]
                 if c["device"] == serial}
        shown = {r.get_attribute("data-series-id"): r.find_element(By.CSS_SELECTOR, ".series-verdict")
                 .get_attribute("data-verdict") for r in browser.find_elements(By.CSS_SELECTOR, "#device-series tbody tr")}
        assert shown == cells
    assert _severe(browser) == []


def test_a_series_page_names_the_kernels_that_moved(farm, server, browser):
    """p1's UNet step: its verdict (b3 against b2, a regression), and the kernels that moved
    between those builds as the API lists them, attention first, as bars and a table."""
    from selenium.webdriver.common.by import By

    ident = _series_id(farm, "p1", "unet_step_ms")
    kernels = _api(farm, f"/v1/series/{ident}/kernels")
    assert kernels["compared"] == {"baseline_build": "b2", "build": "b3"} and kernels["moves"][0]["kernel"] == "attention"
    _sign_in(browser, server, farm["tokens"]["read"])
    browser.get(f"{server}/series/{ident}")
    _ready(browser)
    verdict = browser.find_element(By.CSS_SELECTOR, "#latest-verdict .series-verdict")
    assert verdict.get_attribute("data-verdict") == "regression"
    assert browser.find_element(By.ID, "verdict-builds").text == "b3 against b2"
    rows = browser.find_elements(By.CSS_SELECTOR, "#moves tbody tr")
    assert [r.get_attribute("data-kernel") for r in rows] == [m["kernel"] for m in kernels["moves"]]
    assert [_value(r.find_element(By.CSS_SELECTOR, "td.delta")) for r in rows] == [m["delta_ms"] for m in kernels["moves"]]
    bars = browser.execute_script("return farm.charts['moves-chart'].data[1]")
    assert bars == pytest.approx([m["delta_ms"] for m in kernels["moves"]], rel=1e-12)
    named = {r.get_attribute("data-kernel") for r in browser.find_elements(By.CSS_SELECTOR, "#kernels tbody tr")}
    assert {m["kernel"] for m in kernels["moves"]} <= named
    browser.get(f"{server}/series/{_series_id(farm, 'p1', 'peak_gpu_bytes')}")  # unsettled
    _ready(browser)
    verdict = browser.find_element(By.CSS_SELECTOR, "#latest-verdict .series-verdict")
    assert verdict.get_attribute("data-verdict") == "inconclusive" and verdict.text.endswith("inconclusive")
    assert verdict.value_of_css_property("background-color") not in GREEN
    assert _severe(browser) == []


# ---- alert groups: triaged whole (issue 41) ---------------------------------------------------
# Last in the file: the bulk acknowledge changes the alerts' states the tests above read.


def _group_buttons(browser, group_id: int) -> list:
    from selenium.webdriver.common.by import By

    row = browser.find_element(By.CSS_SELECTOR, f'#open-alerts tr.group-row[data-group-id="{group_id}"]')
    return row.find_elements(By.CSS_SELECTOR, "button.group-action")


def test_a_group_row_triages_its_alerts_with_a_triage_token_only(farm, server, browser):
    """A read token sees the group row with its count, and its triage buttons (and the owner,
    bug and note fields) disabled, saying why; a triage token's Acknowledge acknowledges every
    alert of the group in the store, its bug link is saved, and a change made elsewhere shows
    by itself (the list is read again while the page is open)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    (group_id, alert_ids), *_ = _groups(farm).items()
    _sign_in(browser, server, farm["tokens"]["read"])
    _group_rows_checks(browser, farm)
    buttons = _group_buttons(browser, group_id)
    assert [b.text for b in buttons] == ["Acknowledge", "Invalidate", "Mark fixed"]
    for button in buttons:
        assert not button.is_enabled()
        assert "scope (read) does not grant triage" in button.get_attribute("title")
        assert "farm api token create --scope triage" in button.get_attribute("title")
    _open_group(browser, group_id)
    for row in browser.find_elements(By.CSS_SELECTOR, f'tr.group-alert[data-group-id="{group_id}"]'):
        links, metric = row.find_elements(By.CSS_SELECTOR, "a.series-link"), row.get_attribute("data-metric")
        if metric in METRICS:  # a latency series' alert links to it; a fidelity alert's image has no chart
            assert [a.get_attribute("href") for a in links] == [
                f"{server}/series/{_series_id(farm, row.get_attribute('data-device'), metric)}"]
        else:
            assert links == []
    assert not browser.find_element(By.CSS_SELECTOR, f'tr.group-edit[data-group-id="{group_id}"] .group-save').is_enabled()
    assert all(not box.is_enabled() for box in browser.find_elements(By.CSS_SELECTOR, "tr.group-alert input.pick"))

    browser.find_element(By.ID, "sign-out").click()
    browser.find_element(By.ID, "token-input").send_keys(farm["tokens"]["triage"])
    browser.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
    _ready(browser)
    acknowledge = _group_buttons(browser, group_id)[0]
    assert acknowledge.is_enabled() and "else all" in acknowledge.get_attribute("title")
    acknowledge.click()
    message = browser.find_element(By.ID, "groups-message")
    WebDriverWait(browser, WAIT_S).until(lambda d: message.get_attribute("data-kind") in ("done", "error", "refused"))
    assert message.text == f"Group #{group_id}: {len(alert_ids)} alerts acknowledged.", message.text
    with farm["sessions"]() as s:
        assert {s.get(Alert, a).state for a in alert_ids} == {AlertState.acknowledged}
    count = browser.find_element(By.CSS_SELECTOR, f'tr.group-row[data-group-id="{group_id}"] '
                                                  '.state-count[data-state="acknowledged"]')
    assert count.get_attribute("data-count") == str(len(alert_ids))
    _open_group(browser, group_id)
    bug = browser.find_element(By.CSS_SELECTOR, f'tr.group-edit[data-group-id="{group_id}"] input.edit-bug')
    bug.send_keys("https://bugs.example.com/41")
    browser.find_element(By.CSS_SELECTOR, f'tr.group-edit[data-group-id="{group_id}"] .group-save').click()
    WebDriverWait(browser, WAIT_S).until(lambda d: message.text == f"Group #{group_id} saved.")
    with farm["sessions"]() as s:
        assert store.get_alert_group(s, group_id).group.bug_url == "https://bugs.example.com/41"
    _artifact(browser, "dashboard-live-groups.png")

    browser.execute_script("localStorage.setItem('farm.refresh.ms', '300')")  # read when the page starts
    try:
        browser.get(server + "/")
        _ready(browser)
        with farm["sessions"]() as s, s.begin():
            store.update_alert_group(s, group_id, owner="ana")  # someone else, elsewhere
        WebDriverWait(browser, WAIT_S, ignored_exceptions=[StaleElementReferenceException]).until(
            lambda d: d.find_element(By.CSS_SELECTOR, f'tr.group-row[data-group-id="{group_id}"] td.owner').text == "ana")
    finally:
        browser.execute_script("localStorage.removeItem('farm.refresh.ms')")
    assert _severe(browser) == []
