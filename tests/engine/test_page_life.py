"""A farm page through a phone's life, in headless Chromium (SwiftShader WebGPU) on the farm's
hub: a command that holds the page's main thread for longer than the hub's PAGE_LOST_S still
beats (from the page's worker, with the device's token) and ends well; a GPU device lost in the
middle of a command ends that command as "device-lost", with the reason, and the next command
runs on a new device (and a job ended so is an infrastructure failure, retried). The page is engine/web/page.js under a test's main.js, whose commands
block the main thread, destroy the page's device, and compute on it."""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from ci_support import missing

from agent.protocol import JobResult, JobSpec
from engine.browser import (
    _reap_browser,
    chromium_command,
    default_webgpu_adapter,
    find_chromium,
    private_log,
)
from engine.errors import BrowserError
from engine.pagehost import PAGE_LOST_S, WEB_ROOT
from orchestrator.transports import InfraFailure
from orchestrator.transports import hub as browser_hub
from orchestrator.transports.browser import BrowserTransport, WebPageLink
from orchestrator.transports.hub import BrowserHub

pytestmark = pytest.mark.gpu
SERIAL, TOKEN = "life-1", "token-of-life-1"
LOST_S = 6.0  # the hub's silence limit here, to fail fast; the blocked command runs past PAGE_LOST_S

MAIN_JS = """
import { runPage } from "./page.js";
const params = new URLSearchParams(location.search);
const headers = { Authorization: `Bearer ${params.get("token")}` };
const hostFetch = (url, init = {}) => fetch(url, { ...init, headers: { ...(init.headers || {}), ...headers } });
let devices = 0;
const requestDevice = GPUAdapter.prototype.requestDevice;
GPUAdapter.prototype.requestDevice = function (...args) { devices++; return requestDevice.apply(this, args); };
const sleep = (ms) => new Promise((res) => setTimeout(res, ms));
runPage({ query: { device: params.get("device") }, hostFetch, headers, ops: {
  // the main thread held, as by a long busy GPU loop: no timer of this thread runs meanwhile
  busy: async (cmd) => {
    const end = Date.now() + cmd.ms;
    let spins = 0;
    while (Date.now() < end) spins++;
    return { spins };
  },
  "lose-device": async (cmd, ui) => {
    const d = await ui.gpu();
    setTimeout(() => d.destroy(), cmd.after_ms);
    await sleep(120000);
    return { survived: true };
  },
  compute: async (cmd, ui) => {
    const d = await ui.gpu();
    const data = new Float32Array([1, 2, 3, 4]);
    const src = d.createBuffer({ size: 16, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC });
    const dst = d.createBuffer({ size: 16, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
    d.queue.writeBuffer(src, 0, data);
    const enc = d.createCommandEncoder();
    enc.copyBufferToBuffer(src, 0, dst, 0, 16);
    d.queue.submit([enc.finish()]);
    await dst.mapAsync(GPUMapMode.READ);
    const values = Array.from(new Float32Array(dst.getMappedRange().slice(0)));
    dst.unmap();
    return { values, devices };
  },
} });
"""


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    chromium = find_chromium()
    if not chromium:
        missing("no chromium: bash scripts/ensure-chromium.sh installs it", "CI needs it")
    root = tmp_path_factory.mktemp("page-life")
    (root / "index.html").write_text((WEB_ROOT / "index.html").read_text())
    (root / "main.js").write_text(MAIN_JS)
    saved = browser_hub._Handler.web_roots
    browser_hub._Handler.web_roots = (root, *saved)  # the test's main.js over the farm's
    hub = BrowserHub(page_lost_s=LOST_S, poll_s=4.0)
    hub.register(SERIAL, TOKEN, root / "store")
    profile = tempfile.mkdtemp(prefix="page-life-chromium-")
    log = private_log(Path(profile) / "chromium.log")
    url = f"{hub.local_url}/web/index.html?device={SERIAL}&token={TOKEN}"
    process = subprocess.Popen(chromium_command(chromium, profile, url, default_webgpu_adapter()), stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        hub.wait_online(SERIAL, 90.0)
        yield hub
    finally:
        _reap_browser(process, log, profile)
        hub.close()
        browser_hub._Handler.web_roots = saved


def test_a_command_that_holds_the_main_thread_past_page_lost_s_still_beats(page):
    channel = page.device(SERIAL).channel
    gaps, calling = [], threading.Event()

    def watch():  # the longest silence the hub hears while the command runs
        calling.wait()
        while calling.is_set():
            gaps.append(time.monotonic() - channel.seen)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    calling.set()
    started = time.monotonic()
    try:
        result = page.call(SERIAL, "busy", ms=int((PAGE_LOST_S + 5) * 1000), timeout_s=120)
    finally:
        calling.clear()
        watcher.join()
    assert result["spins"] > 0 and time.monotonic() - started > PAGE_LOST_S + 5
    # Beats every 3 s, while no timer of the page's main thread could run for 20 s
    assert max(gaps) < LOST_S - 1, f"the hub went {max(gaps):.1f} s without a word"
    assert page.status(SERIAL)["online"]


def test_a_device_lost_mid_command_is_a_structured_error_and_the_next_command_gets_a_new_device(page, tmp_path):
    first = page.call(SERIAL, "compute", timeout_s=60)
    assert first["values"] == [1, 2, 3, 4]
    started = time.monotonic()
    with pytest.raises(BrowserError, match="destroyed") as err:
        page.call(SERIAL, "lose-device", after_ms=500, timeout_s=60)
    assert err.value.kind == "device-lost" and time.monotonic() - started < 20
    after = page.call(SERIAL, "compute", timeout_s=60)
    assert after["values"] == [1, 2, 3, 4] and after["devices"] == first["devices"] + 1
    # A job whose command ended so is the infrastructure's failure, retried: never the job's own
    link = WebPageLink("https://localhost:1", SERIAL)
    transport = BrowserTransport(tmp_path / "root", link, TOKEN, tmp_path / "farm.pub", name=SERIAL, hub=page)
    failed = JobResult(job_id="j1", kind="generate", status="failed", error=str(err.value))
    with pytest.raises(InfraFailure, match="device-lost"):
        transport.finish_result(JobSpec(job_id="j1", kind="generate", model="models/tiny"), failed)
