"""Browser devices over HTTPS (the web transport): the hub serves its page with a certificate of
the farm's own CA; a virtual tablet (headless Chromium whose NSS database trusts that CA, as a
person's device does once the CA is installed) opens the enrolment URL itself, and the farm
drives it through the hub's farm side from another "process" (HubClient). Device info from the
page (no thermal readings: a page cannot read them), a deploy the page verifies and caches once,
a latency job, a client without the farm's CA refused by TLS, a token the farm does not know
refused, and a tab closed: the device is offline until it opens the page again."""

from __future__ import annotations

import contextlib
import shutil
import ssl
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ci_support import missing

from agent.bundle import generate_keypair
from agent.packing import build_bundle
from agent.protocol import JobSpec
from agent.simulator.tablet import VirtualTablet
from engine.browser import find_chromium
from engine.kernels import SHADER_ROOT
from orchestrator.infra import ca
from orchestrator.transports import DeviceOffline
from orchestrator.transports.browser import BrowserTransport, WebPageLink, enrolment_url
from orchestrator.transports.hub import BrowserHub, HubClient, read_or_make_token

pytestmark = pytest.mark.gpu
SERIAL = "tablet-1"


@pytest.fixture(scope="module")
def farm(tmp_path_factory, tiny_model_dir):
    if not find_chromium():
        missing("no chromium: bash scripts/ensure-chromium.sh installs it", "CI needs it")
    if not shutil.which("certutil"):
        missing("no certutil (libnss3-tools): bash scripts/ensure-chromium.sh installs it", "CI needs it")
    tmp = tmp_path_factory.mktemp("web")
    key = generate_keypair(tmp / "farm.key", tmp / "farm.pub")
    manifest = build_bundle({"models/tiny": tiny_model_dir, "shaders": SHADER_ROOT}, tmp / "b1", "b1", "0.1.0", key)
    ca.init_ca(tmp / "ca", "devicefarm test CA")
    context = ca.server_ssl_context(tmp / "ca", ["localhost", "127.0.0.1"])
    token = read_or_make_token(tmp / "tokens" / SERIAL)  # what `farm devices add --transport web` makes
    hub = BrowserHub(https=("127.0.0.1", 0, context), page_lost_s=6.0, poll_s=4.0, tokens_dir=tmp / "tokens",
                     stores=tmp / "devices")
    origin = f"https://localhost:{hub.https_port}"
    tablet = VirtualTablet(tmp / "tablet", tmp / "ca" / ca.CA_CERT)
    tablet.open(enrolment_url(origin, SERIAL, token, tmp / "farm.pub", virtual=True))
    client = HubClient(hub.local_url, hub.key)
    transport = BrowserTransport(tmp / "devices" / SERIAL, WebPageLink(origin, SERIAL), token, tmp / "farm.pub",
                                 name=SERIAL, hub=client)
    try:
        client.wait_online(SERIAL, 90.0)
        yield {"tmp": tmp, "hub": hub, "transport": transport, "tablet": tablet, "manifest": manifest,
               "origin": origin, "token": token}
    finally:
        tablet.close()
        hub.close()


def test_the_tablet_enrolled_itself_and_reports_its_browser(farm):
    info = farm["transport"].info()
    assert info.os == "linux" and info.adapter["architecture"] == "swiftshader"  # what its user agent says
    assert info.thermal == [] and info.properties["thermal"].startswith("unknown")
    assert info.virtual  # it said so at enrolment: grouped with this host's adapter
    assert info.properties["browser"] in ("HeadlessChrome", "Chrome")
    assert info.properties["page_secure_context"] == "True"


def test_a_deploy_over_https_is_verified_cached_and_sent_once(farm):
    files = [f for f in farm["manifest"].files if f.path.startswith("shaders/") or f.path.endswith(".safetensors")]
    first = farm["transport"].send_bundle(farm["tmp"] / "b1")
    assert first.bytes_sent == sum({f.sha256: f.size for f in files}.values())
    second = farm["transport"].send_bundle(farm["tmp"] / "b1")
    assert (second.bytes_sent, second.installed) == (0, False)


def test_a_latency_job_runs_in_the_tablets_page(farm, tmp_path):
    t = farm["transport"]
    t.send_bundle(farm["tmp"] / "b1")
    spec = JobSpec(job_id="web-lat", kind="latency", model="models/tiny", precision="fp32", height=32, width=32,
                   steps=1, scheduler="euler", warmup=1, repetitions=1, unet_repetitions=3, time_limit_s=300.0,
                   executor="browser")
    result = t.run(spec, tmp_path / "out")
    assert result.status == "succeeded", result.error
    assert len([s for s in result.samples if s.metric == "unet_step_ms"]) == 3
    assert result.environment.runtime["kind"] == "browser" and result.thermal == []


def test_tls_and_tokens_keep_strangers_out(farm):
    page = f"{farm['origin']}/web/index.html"
    with pytest.raises(urllib.error.URLError) as err:  # no trust in the farm's CA: refused by TLS
        urllib.request.urlopen(page, timeout=10, context=ssl.create_default_context())
    assert isinstance(err.value.reason, ssl.SSLCertVerificationError)
    trusting = ssl.create_default_context(cafile=str(farm["tmp"] / "ca" / ca.CA_CERT))
    with urllib.request.urlopen(page, timeout=10, context=trusting) as r:
        assert b"devicefarm engine" in r.read()
    for token in ("", "a-token-no-device-has"):
        req = urllib.request.Request(f"{farm['origin']}/api/next", headers={"Authorization": f"Bearer {token}"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10, context=trusting)
        assert refused.value.code == 401


def test_the_token_is_on_no_command_line_and_in_no_log_others_can_read(farm):
    """The tablet put its enrolment URL (the device's token, the farm key) on Chromium's command
    line, where `ps` shows it to every user, and in a chromium.log of mode 0644 (issue 27, item
    10). Chromium now starts on a private page that opens the URL."""
    token = farm["token"]
    seen = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and token.encode() in (proc / "cmdline").read_bytes():
                seen.append((proc / "cmdline").read_bytes().replace(b"\0", b" ")[:200])
    assert seen == []
    log = farm["tmp"] / "tablet" / "chromium.log"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and token not in log.read_text(errors="replace")
    launch = farm["tmp"] / "tablet" / "launch" / "open.html"
    assert stat.S_IMODE(launch.stat().st_mode) == 0o600


def test_the_demo_stack_passes_the_tablets_url_in_a_private_file(tmp_path, monkeypatch):
    from orchestrator.infra.settings import Settings
    from orchestrator.services.stack import Stack

    spawned = []
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, argv, *a, **k: spawned.append(argv))
    url = "https://localhost:8743/web/index.html#device=vtablet-1&token=SECRET-TOKEN&key=K"
    Stack(Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config")).start_tablet(
        "vtablet-1", url, tmp_path / "ca.pem")
    (argv,) = spawned
    assert not any("SECRET-TOKEN" in arg for arg in argv), argv
    url_file = Path(argv[argv.index("--url-file") + 1])
    assert url_file.read_text().strip() == url and stat.S_IMODE(url_file.stat().st_mode) == 0o600


def test_a_closed_tab_leaves_the_device_offline_until_it_opens_the_page_again(farm):
    """Last: it closes the tab."""
    farm["tablet"].kill()
    hub = farm["hub"]
    deadline = time.monotonic() + 30
    while hub.online(SERIAL) and time.monotonic() < deadline:
        time.sleep(0.5)
    with pytest.raises(DeviceOffline, match="open it there once"):
        farm["transport"].info()
    farm["tablet"].open(f"{farm['origin']}/web/index.html")  # enrolled: its token is in the page's storage
    HubClient(hub.local_url, hub.key).wait_online(SERIAL, 90.0)
    assert farm["transport"].info().properties["engine_host"] == "browser"
