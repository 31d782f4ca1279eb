"""The self-contained HTML dashboard (orchestrator/dashboard, `farm dashboard build | serve`)
on a migrated SQLite store filled through the models: the site is written whole (alert pages,
images copied in), and in headless Chromium (Debian's chromium and chromedriver, driven by
selenium; scripts/ensure-chromium.sh installs them) it loads from file:// with no console
error, draws a trend chart with bands and a median line for every device and key metric, marks
the alerts on them, and following an alert link opens its page with the compare table, the
kernel attribution and both images. Screenshots are kept as test artifacts (the pytest tmp dir,
and $FARM_TEST_ARTIFACTS when set). Without a browser the browser tests skip locally and fail in
CI (CI=true)."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import struct
import threading
import urllib.request
import zlib
from pathlib import Path

import pytest
from ci_support import missing
from typer.testing import CliRunner

DEVICES = ("phone-a", "phone-b")
BUILDS = ("build-1", "build-2", "build-3")


def _png(path: Path, rgb: tuple[int, int, int], size: int = 24) -> None:
    """A small solid-colour PNG (zlib only, no imaging library)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes(rgb) * size for _ in range(size))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def seed(Session, data_dir: Path) -> dict[str, int]:  # noqa: N803  (a session factory)
    """Two devices, three builds, one latency run per device and build (samples, kernel timings,
    thermal readings), a regression alert with attribution and images, and an improvement alert."""
    from orchestrator.db.models import (
        Alert,
        AlertKind,
        AlertState,
        Build,
        Device,
        DeviceState,
        Job,
        JobKind,
        KernelTiming,
        Run,
        RunStatus,
        Sample,
        ThermalReading,
        TransportKind,
    )

    t0 = dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
    _png(data_dir / "images" / "before.png", (40, 120, 200))  # relative in the alert: read under data_dir
    _png(data_dir / "elsewhere" / "after.png", (200, 60, 40))  # absolute in the alert
    with Session() as s, s.begin():
        devices = [Device(serial="phone-a", transport=TransportKind.adb, model="Pixel 8", state=DeviceState.available,
                          last_seen=t0),
                   Device(serial="phone-b", transport=TransportKind.adb, model="Galaxy S23",
                          state=DeviceState.quarantined, state_reason="overheating", last_seen=t0)]
        builds = [Build(name=name, version=f"1.{i}", manifest_sha256=f"{i:064d}", created=t0 + dt.timedelta(days=i))
                  for i, name in enumerate(BUILDS)]
        s.add_all([*devices, *builds])
        s.flush()
        for d, device in enumerate(devices):
            for b, build in enumerate(builds):
                slow = 1.25 if (device.serial, build.name) == ("phone-a", "build-3") else 1.0
                job = Job(kind=JobKind.latency, spec={}, device_id=device.id, build_id=build.id)
                s.add(job)
                s.flush()
                run = Run(job_id=job.id, attempt=1, device_id=device.id, build_id=build.id,
                          status=RunStatus.succeeded, engine={}, artifacts=[], cooldown_wait_s=5.0 + b,
                          cooldown_timed_out=(d, b) == (1, 2), started_at=build.created,
                          finished_at=build.created + dt.timedelta(minutes=3))
                s.add(run)
                s.flush()
                for r in range(6):
                    s.add(Sample(run_id=run.id, metric="unet_step_ms", unit="ms",
                                 value=(80.0 + 20 * d + (r % 3)) * slow, repetition=r))
                    s.add(Sample(run_id=run.id, metric="e2e_ms", unit="ms", value=(2000.0 + 5 * r) * slow,
                                 repetition=r))
                s.add(Sample(run_id=run.id, metric="peak_gpu_bytes", unit="bytes", value=1.5e9, repetition=0))
                s.add_all([KernelTiming(run_id=run.id, kernel=k, calls=8, total_ms=ms * slow, repetition=0)
                           for k, ms in (("attention", 30.0), ("conv2d", 25.0), ("groupnorm", 4.0))])
                s.add_all([ThermalReading(run_id=run.id, phase=phase, zone=zone, celsius=c + 10 * d)
                           for phase, zone, c in (("before", "gpu", 36.0), ("before", "cpu", 35.0),
                                                  ("after", "gpu", 48.5), ("after", "cpu", 44.0))])
        regression = Alert(
            kind=AlertKind.regression, device_id=devices[0].id, build_id=builds[2].id,
            baseline_build_id=builds[1].id, metric="unet_step_ms", series={"device": "phone-a", "metric": "unet_step_ms"},
            ratio=1.25, ci_low=1.19, ci_high=1.31, p_value=0.0021, summary="unet_step_ms 25% slower on phone-a",
            detail={"baseline_median": 81.0, "candidate_median": 101.25, "n_baseline": 6, "n_new": 6,
                    "metrics": [{"metric": "e2e_ms", "baseline": 2012.5, "new": 2515.6, "ratio": 1.25,
                                 "ci_low": 1.2, "ci_high": 1.3, "p_value": 0.002}],
                    "attribution": [{"kernel": "attention", "baseline_ms": 30.0, "candidate_ms": 37.5,
                                     "delta_ms": 7.5, "share": 0.5},
                                    {"kernel": "conv2d", "baseline_ms": 25.0, "candidate_ms": 31.25,
                                     "delta_ms": 6.25, "share": 0.42},
                                    {"kernel": "groupnorm", "delta_ms": 1.0, "share": 0.08}],
                    "images": {"before": "images/before.png",
                               "after": str(data_dir / "elsewhere" / "after.png")}})
        improvement = Alert(
            kind=AlertKind.improvement, state=AlertState.acknowledged, device_id=devices[1].id,
            build_id=builds[1].id, baseline_build_id=builds[0].id, metric="e2e_ms", series={"metric": "e2e_ms"},
            ratio=0.97, ci_low=0.95, ci_high=0.99, p_value=0.03, summary="e2e_ms 3% faster on phone-b", detail={})
        s.add_all([regression, improvement])
        s.flush()
        return {"regression": regression.id, "improvement": improvement.id}


@pytest.fixture
def store(tmp_path):
    """(session factory, data dir, alert ids, database URL) of a seeded, migrated SQLite store."""
    from orchestrator.db import make_engine, make_session_factory, upgrade

    url = f"sqlite:///{tmp_path / 'farm.db'}"
    upgrade(url)
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    data_dir = tmp_path / "data"
    ids = seed(sessions, data_dir)
    yield sessions, data_dir, ids, url
    engine.dispose()


@pytest.fixture
def site(store, tmp_path) -> tuple[Path, dict[str, int]]:
    from orchestrator.dashboard import build_site

    sessions, data_dir, ids, _ = store
    index = build_site(sessions, tmp_path / "site", image_root=data_dir)
    return index, ids


# ---- the files ------------------------------------------------------------------------------


def test_the_site_is_written_whole_and_needs_nothing_outside_it(site):
    index, ids = site
    out = index.parent
    assert {p.name for p in (out / "alerts").iterdir()} == {f"alert-{i}.html" for i in ids.values()}
    images = sorted(p.name for p in (out / "images").iterdir())
    assert images == [f"alert-{ids['regression']}-after.png", f"alert-{ids['regression']}-before.png"]
    for page in [index, *(out / "alerts").iterdir()]:
        html = page.read_text()
        assert "<script" not in html and "http://" not in html and "https://" not in html, page
        assert "<link" not in html, f"{page} loads an external stylesheet"


def test_a_missing_image_is_named_not_broken(store, tmp_path):
    from orchestrator.dashboard import build_site

    sessions, data_dir, ids, _ = store
    (data_dir / "images" / "before.png").unlink()
    index = build_site(sessions, tmp_path / "site2", image_root=data_dir)
    page = (index.parent / "alerts" / f"alert-{ids['regression']}.html").read_text()
    assert "image not found: images/before.png" in page
    assert page.count('class="alert-image"') == 1


def test_an_empty_store_builds_an_empty_site(tmp_path):
    from orchestrator.dashboard import build_site
    from orchestrator.db import make_engine, make_session_factory, upgrade

    url = f"sqlite:///{tmp_path / 'empty.db'}"
    upgrade(url)
    engine = make_engine(url)
    try:
        index = build_site(make_session_factory(engine), tmp_path / "site")
    finally:
        engine.dispose()
    html = index.read_text()
    assert "No devices yet." in html and "No alerts." in html


# ---- the CLI ---------------------------------------------------------------------------------


@pytest.fixture
def cli_env(store, monkeypatch, tmp_path):
    _, data_dir, ids, url = store
    monkeypatch.setenv("FARM_DATABASE_URL", url)
    monkeypatch.setenv("FARM_DATA_DIR", str(data_dir))
    monkeypatch.setenv("FARM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("FARM_BROKER_URL", raising=False)
    return data_dir, ids


def test_farm_dashboard_build_writes_the_site(cli_env, tmp_path):
    from orchestrator.cli import app

    data_dir, ids = cli_env
    result = CliRunner().invoke(app, ["dashboard", "build", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "dashboard written" in result.output
    assert "phone-a" in (tmp_path / "out" / "index.html").read_text()
    # relative image paths resolve under the settings' data_dir
    assert (tmp_path / "out" / "images" / f"alert-{ids['regression']}-before.png").is_file()
    # without --out the site goes to <data_dir>/dashboard
    result = CliRunner().invoke(app, ["dashboard", "build"])
    assert result.exit_code == 0, result.output
    assert (data_dir / "dashboard" / "index.html").is_file()


def test_farm_dashboard_serve_rebuilds_and_serves_the_folder(cli_env, tmp_path, monkeypatch):
    import http.server

    from orchestrator.cli import app

    _, ids = cli_env
    fetched: dict[str, bytes] = {}
    serve_forever = http.server.ThreadingHTTPServer.serve_forever

    def serve_then_stop(self, *args, **kwargs):
        """Serve as usual while a client fetches two pages, then stop the server."""
        def client():
            try:
                base = f"http://127.0.0.1:{self.server_address[1]}/"
                for page in ("index.html", f"alerts/alert-{ids['regression']}.html"):
                    with urllib.request.urlopen(base + page, timeout=10) as response:
                        fetched[page] = response.read()
            finally:
                self.shutdown()

        threading.Thread(target=client, daemon=True).start()
        serve_forever(self, *args, **kwargs)

    monkeypatch.setattr(http.server.ThreadingHTTPServer, "serve_forever", serve_then_stop)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "index.html").write_text("stale")
    result = CliRunner().invoke(app, ["dashboard", "serve", "--port", "0", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "serving" in result.output
    assert b"phone-a" in fetched["index.html"], "the site was not rebuilt before serving"
    assert b'id="compare"' in fetched[f"alerts/alert-{ids['regression']}.html"]


def test_farm_dashboard_build_on_an_unmigrated_store_is_one_error(tmp_path, monkeypatch):
    from orchestrator.cli import app

    monkeypatch.setenv("FARM_DATABASE_URL", f"sqlite:///{tmp_path / 'none.db'}")
    monkeypatch.setenv("FARM_DATA_DIR", str(tmp_path / "data"))
    result = CliRunner().invoke(app, ["dashboard", "build", "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "error:" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out" / "index.html").exists()


# ---- in a real browser -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (Debian's) through selenium, with the browser console log kept."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        message = "no chromium/chromedriver: bash scripts/ensure-chromium.sh installs them"
        missing(message, "CI needs them")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1600", "--allow-file-access-from-files"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _severe(driver) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def _artifact(driver, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    assert driver.save_screenshot(str(shot)), "no screenshot"
    assert shot.stat().st_size > 1000
    if os.environ.get("FARM_TEST_ARTIFACTS"):
        target = Path(os.environ["FARM_TEST_ARTIFACTS"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target / name)
    return shot


def test_the_dashboard_in_headless_chromium(site, browser, tmp_path):
    from selenium.webdriver.common.by import By

    index, ids = site
    browser.get_log("browser")  # start from an empty console
    browser.get(index.as_uri())
    assert browser.title == "devicefarm dashboard"
    assert _severe(browser) == []

    # the device list, with state and temperatures
    rows = browser.find_elements(By.CSS_SELECTOR, "#device-table tr")[1:]
    assert [r.find_element(By.CSS_SELECTOR, "td").text for r in rows] == list(DEVICES)
    assert "quarantined" in rows[1].text and "58.5 °C" in rows[1].text  # phone-b's hottest zone after a run

    # every device has a drawn chart per key metric: bands and a median line, really laid out
    for device in DEVICES:
        charts = browser.find_elements(By.CSS_SELECTOR, f'svg.trend[data-device="{device}"]')
        assert {c.get_attribute("data-metric") for c in charts} == {"unet_step_ms", "e2e_ms", "peak_gpu_bytes"}
        for chart in charts:
            assert chart.is_displayed() and chart.size["width"] > 200 and chart.size["height"] > 100
            for part in ("path.band-range", "path.band-iqr", "path.median"):
                path = chart.find_element(By.CSS_SELECTOR, part)
                assert path.get_attribute("d").count("L") >= 2, (device, part)
                box = browser.execute_script("const b = arguments[0].getBBox(); return [b.width, b.height];", path)
                assert box[0] > 0, (device, part, box)
            assert len(chart.find_elements(By.CSS_SELECTOR, "circle.point")) == len(BUILDS)

    # alert markers sit on the charts of the series they are about
    marker = browser.find_element(By.CSS_SELECTOR, 'svg.trend[data-device="phone-a"][data-metric="unet_step_ms"] '
                                                   "a.alert-link")
    assert marker.get_dom_attribute("href").endswith(f"alerts/alert-{ids['regression']}.html")
    assert browser.find_elements(By.CSS_SELECTOR, 'svg.trend[data-device="phone-b"][data-metric="e2e_ms"] '
                                                  "path.alert-improvement")
    _artifact(browser, tmp_path, "dashboard-index.png")

    # follow the regression's link in the alerts list
    browser.find_element(By.CSS_SELECTOR, f'#alert-table a[href="alerts/alert-{ids["regression"]}.html"]').click()
    assert browser.current_url.endswith(f"/alerts/alert-{ids['regression']}.html")
    assert browser.find_element(By.TAG_NAME, "h1").text.startswith(f"Alert #{ids['regression']}")
    compare = [[c.text for c in r.find_elements(By.TAG_NAME, "td")]
               for r in browser.find_elements(By.CSS_SELECTOR, "#compare tr")[1:]]
    assert compare[0] == ["unet_step_ms", "81", "101.2", "1.25", "[1.19, 1.31]", "0.0021"]
    assert compare[1][0] == "e2e_ms" and compare[1][3] == "1.25"
    kernels = [[c.text for c in r.find_elements(By.TAG_NAME, "td")][:5]
               for r in browser.find_elements(By.CSS_SELECTOR, "#attribution tr")[1:]]
    assert kernels == [["attention", "30", "37.5", "7.5", "50.0%"], ["conv2d", "25", "31.25", "6.25", "42.0%"],
                       ["groupnorm", "—", "—", "1", "8.0%"]]  # in the analysis' order, largest move first
    images = browser.find_elements(By.CSS_SELECTOR, "img.alert-image")
    assert len(images) == 2
    for image in images:
        assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) == 24
    assert _severe(browser) == []
    _artifact(browser, tmp_path, "dashboard-alert.png")

    # and the chart marker leads to the same page
    browser.back()
    browser.find_element(By.CSS_SELECTOR, 'svg.trend[data-device="phone-a"][data-metric="unet_step_ms"] '
                                          "path.alert-marker").click()
    assert browser.current_url.endswith(f"/alerts/alert-{ids['regression']}.html")
    assert _severe(browser) == []


def test_the_console_check_sees_errors(site, browser, tmp_path):
    """What the test above relies on: a broken image on a page is a SEVERE console entry."""
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body><img src="missing.png"></body></html>')
    browser.get_log("browser")
    browser.get(page.as_uri())
    assert _severe(browser), "a missing image did not show in the browser log"
