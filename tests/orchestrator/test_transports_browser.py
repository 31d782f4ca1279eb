"""The browser executor's transport over ADB, end to end through the virtual phone: adb-shell ->
reverse forward -> the phone's Chromium (headless, SwiftShader WebGPU) opened by `am start` ->
the farm's hub -> the page. Device info from the phone and its page, a deploy the page verifies
and caches (a second sends nothing), latency and generate jobs whose JobResults carry the
phone's readings and the browser's identity, and a browser killed mid-job reported as an
infrastructure failure, after which the next job runs."""

from __future__ import annotations

import json
import threading
import time

import pytest
from ci_support import missing

from agent.bundle import generate_keypair
from agent.packing import build_bundle
from agent.protocol import AGENT_CONFIG_FILE, Cooldown, JobSpec, Manifest
from agent.simulator import VirtualPhone
from engine.browser import find_chromium
from engine.kernels import SHADER_ROOT
from orchestrator.transports import InfraFailure
from orchestrator.transports.adb import AdbTransport, load_or_create_adb_key
from orchestrator.transports.base import ProtocolMismatch
from orchestrator.transports.browser import AdbPageLink, BrowserTransport
from orchestrator.transports.hub import BrowserHub

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def farm(tmp_path_factory, tiny_model_dir):
    if not find_chromium():
        missing("no chromium: bash scripts/ensure-chromium.sh installs it", "CI needs it")
    tmp = tmp_path_factory.mktemp("farm")
    key = generate_keypair(tmp / "farm.key", tmp / "farm.pub")
    manifest = build_bundle({"models/tiny": tiny_model_dir, "shaders": SHADER_ROOT}, tmp / "b1", "b1", "0.1.0", key)
    hub = BrowserHub(page_lost_s=6.0, poll_s=4.0)
    yield {"bundle": tmp / "b1", "pub": tmp / "farm.pub", "manifest": manifest, "hub": hub}
    hub.close()


@pytest.fixture(scope="module")
def phone(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("phone")
    key = load_or_create_adb_key(tmp / "keys" / "adbkey")
    with VirtualPhone(serial="sim-browser", root=tmp / "phone", adb_keys=key.with_name(key.name + ".pub")) as p:
        p.key_path = tmp / "keys" / "adbkey"
        yield p


@pytest.fixture(scope="module")
def browser(phone, farm, tmp_path_factory):
    adb = AdbTransport("127.0.0.1", phone.port, key_path=phone.key_path, name="sim-browser")
    t = BrowserTransport(tmp_path_factory.mktemp("host-root"), AdbPageLink(adb), "token-of-sim-browser",
                         farm["pub"], name="sim-browser", hub=farm["hub"])
    yield t
    t.close()


def page_bytes(manifest: Manifest) -> int:
    return sum({f.sha256: f.size for f in manifest.files
                if f.path.startswith("shaders/") or f.path.endswith(".safetensors")}.values())


def job(job_id: str, **kw) -> JobSpec:
    """A job the transport runs: the tiny model's smallest image (32x32) and one step, since
    these tests are about the link to the page, not its numbers (tests/engine/test_browser.py)."""
    return JobSpec(**({"job_id": job_id, "kind": "generate", "model": "models/tiny", "precision": "fp32",
                       "steps": 1, "scheduler": "euler", "time_limit_s": 300.0, "height": 32, "width": 32,
                       "executor": "browser"} | kw))


def test_info_is_the_phone_with_its_browser_and_adapter(browser, phone):
    info = browser.info()
    assert (info.serial, info.os, info.virtual) == ("sim-browser", "android", True)
    assert info.adapter["architecture"] == "swiftshader"
    assert info.properties["engine_host"] == "browser" and info.properties["browser"] in ("HeadlessChrome", "Chrome")
    assert info.properties["page_secure_context"] == "True"  # http://localhost over the reverse forward
    assert phone.browser_running()


def test_a_deploy_is_verified_and_cached_by_the_page_and_sent_once(browser, farm):
    first = browser.send_bundle(farm["bundle"])
    assert first.installed and first.bytes_sent == page_bytes(farm["manifest"])
    second = browser.send_bundle(farm["bundle"])
    assert (second.bytes_sent, second.files_sent, second.installed) == (0, 0, False)


def test_latency_and_generate_jobs_run_in_the_page(browser, farm, tmp_path):
    browser.send_bundle(farm["bundle"])
    events = []
    latency = browser.run(job("lat-1", kind="latency", warmup=1, repetitions=1, unet_repetitions=3,
                              cooldown=Cooldown(max_celsius=99.0, max_wait_s=10.0, poll_s=0.5)),
                          tmp_path / "lat", progress=events.append)
    assert latency.status == "succeeded", latency.error
    # the cool-down waited on the phone's own zones, read over ADB (the host's are not the phone's)
    assert latency.cooldown_wait_s is not None and "[farm] cool-down:" in latency.log_tail
    assert any(e.get("event") == "cooldown" for e in events)
    assert len([s for s in latency.samples if s.metric == "unet_step_ms"]) == 3
    assert latency.environment.runtime["kind"] == "browser" and latency.environment.os == "android"
    assert {r.phase for r in latency.thermal} == {"before", "after"}  # the phone's own zones
    assert any(e.get("event") == "step" for e in events)
    generated = browser.run(job("gen-1", prompt="a red bicycle", seed=3), tmp_path / "gen")
    assert generated.status == "succeeded", generated.error
    assert (tmp_path / "gen" / "image.png").is_file()
    # the page reached the agent as its configuration, for its owner's eyes only (the URL holds the hub's key)
    config = browser.root / AGENT_CONFIG_FILE
    assert json.loads(config.read_text())["browser_page"].startswith("http://127.0.0.1:")
    assert config.stat().st_mode & 0o077 == 0
    # who runs a job is decided when it is submitted: a job for another executor is refused here
    with pytest.raises(ProtocolMismatch, match="asks for the native executor"):
        browser.run(job("native-1", executor="native"), tmp_path / "native")


def test_a_browser_killed_mid_job_is_an_infrastructure_failure_then_the_next_job_runs(browser, farm, phone,
                                                                                      tmp_path):
    browser.send_bundle(farm["bundle"])

    def kill_when_running() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list((browser.root / "jobs").glob("doomed/task.json")):
            time.sleep(0.2)
        time.sleep(3.0)  # into the job's work in the page
        phone.kill_browser()

    killer = threading.Thread(target=kill_when_running, daemon=True)
    killer.start()
    with pytest.raises(InfraFailure, match="page-lost"):
        browser.run(job("doomed", kind="latency", warmup=0, repetitions=50, unet_repetitions=500), tmp_path / "d")
    killer.join()
    after = browser.run(job("after"), tmp_path / "after")  # the page is opened again
    assert after.status == "succeeded", after.error
