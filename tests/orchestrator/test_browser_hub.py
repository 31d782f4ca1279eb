"""The farm's hub for browser devices (orchestrator/transports/hub.py) with the real page
(agent/web, on engine/web) in Debian's headless Chromium on SwiftShader: enrolment by token and farm key, a
signed build deployed into the page's cache (verified with WebCrypto Ed25519; a second deploy
fetches nothing; a build signed by another key or altered is refused), a generation run from the
deployed build through the hub's farm side equal to the plan executor's (PSNR >= 40 dB) with no
byte fetched at run time, an unknown token or another device's refused, and a page killed
mid-command reported as lost."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from ci_support import missing
from cryptography.hazmat.primitives import serialization

import engine
from agent.bundle import generate_keypair, load_public_key, provision_public_key
from agent.hubpage import HubPage
from agent.packing import build_bundle
from agent.protocol import Manifest, from_json
from engine.browser import BrowserError, chromium_command, find_chromium
from engine.kernels import SHADER_ROOT
from orchestrator.transports.hub import BrowserHub
from orchestrator.transports.local import LocalTransport

pytestmark = pytest.mark.gpu

TOKEN = "t0k3n-of-the-test-device"


def raw_key(pub: Path) -> str:
    raw = load_public_key(pub).public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


@pytest.fixture(scope="module")
def farm(tmp_path_factory, tiny_model_dir):
    if not find_chromium():
        missing("no chromium: bash scripts/ensure-chromium.sh installs it", "CI needs it")
    tmp = tmp_path_factory.mktemp("hub")
    sources = {"models/tiny": tiny_model_dir, "shaders": SHADER_ROOT}
    key = generate_keypair(tmp / "farm.key", tmp / "farm.pub")
    build_bundle(sources, tmp / "b1", "b1", "0.1.0", key)
    build_bundle(sources, tmp / "rogue", "rogue", "0.1.0", generate_keypair(tmp / "r.key", tmp / "r.pub"))
    root = tmp / "root"
    provision_public_key(root, tmp / "farm.pub")
    LocalTransport(root).send_bundle(tmp / "b1")  # the host side of the device holds the build
    hub = BrowserHub(page_lost_s=6.0, poll_s=4.0)
    hub.register("d1", TOKEN, root / "store")
    profile = tempfile.mkdtemp(prefix="hub-chromium-")
    url = f"{hub.local_url}/web/index.html#device=d1&token={TOKEN}&key={raw_key(tmp / 'farm.pub')}"
    log = open(Path(profile) / "chromium.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(chromium_command(find_chromium(), profile, url, "swiftshader"), stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        hub.wait_online("d1", 60.0)
        yield {"hub": hub, "root": root, "tmp": tmp, "proc": proc}
    finally:
        proc.kill()
        proc.wait()
        log.close()
        hub.close()
        shutil.rmtree(profile, ignore_errors=True)


def deploy_fields(bundle: Path) -> dict:
    manifest = from_json(Manifest, (bundle / "manifest.json").read_bytes())
    files = [f.path for f in manifest.files if f.path.startswith("shaders/") or f.path.endswith(".safetensors")]
    return {"build": manifest.build, "manifest_b64": base64.b64encode(manifest.canonical_bytes()).decode(),
            "signature_b64": base64.b64encode((bundle / "manifest.sig").read_bytes()).decode(), "files": files,
            "_sizes": sum({f.sha256: f.size for f in manifest.files if f.path in files}.values())}


def test_a_signed_build_is_cached_once_and_runs_from_the_cache(farm):
    hub = farm["hub"]
    hello = hub.call("d1", "hello")
    assert hello["secure"] is True and hello["device"] == "d1" and hello["key"] is True
    fields = deploy_fields(farm["tmp"] / "b1")
    expected = fields.pop("_sizes")
    first = hub.call("d1", "deploy", timeout_s=120, **fields)
    assert first["fetched_bytes"] == expected == hub.device("d1").bytes_served
    second = hub.call("d1", "deploy", timeout_s=120, **fields)
    assert (second["fetched_bytes"], second["fetched_files"]) == (0, 0)
    assert second["held_files"] == first["fetched_files"]
    assert hub.device("d1").bytes_served == expected  # the re-deploy sent nothing

    model = farm["root"] / "builds" / "current" / "models" / "tiny"
    args = {"prompt": "a red bicycle", "steps": 2, "scheduler": "euler", "seed": 4, "height": 64, "width": 64}
    with engine.load_pipeline(model, precision="fp32", executor="browser", session=HubPage(hub.control_url("d1"))) as page:
        image = page.generate(**args).image
    with engine.load_pipeline(model, precision="fp32", executor="plan") as plan:
        reference = plan.generate(**args).image
    assert hub.device("d1").bytes_served == expected  # shaders and weights came from the page's cache
    mse = np.mean((image.astype(np.float64) - reference.astype(np.float64)) ** 2)
    psnr = 10 * np.log10(255.0**2 / max(mse, 1e-12))
    assert psnr >= 40.0, f"browser vs plan executor: {psnr:.1f} dB"


def test_a_build_the_page_cannot_verify_is_refused(farm):
    hub = farm["hub"]
    rogue = deploy_fields(farm["tmp"] / "rogue")
    rogue.pop("_sizes")
    with pytest.raises(BrowserError, match="signature does not verify") as err:
        hub.call("d1", "deploy", **rogue)
    assert err.value.kind == "signature"
    altered = deploy_fields(farm["tmp"] / "b1")
    altered.pop("_sizes")
    canonical = base64.b64decode(altered["manifest_b64"]).replace(b'"version":"0.1.0"', b'"version":"0.1.1"')
    altered["manifest_b64"] = base64.b64encode(canonical).decode()
    with pytest.raises(BrowserError, match="signature does not verify"):
        hub.call("d1", "deploy", **altered)


def test_requests_without_the_device_token_are_refused(farm):
    hub = farm["hub"]
    for headers in ({}, {"Authorization": "Bearer someone-elses-token"}):
        req = urllib.request.Request(f"{hub.local_url}/api/next", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 401
    hub.register("d2", "token-of-d2", farm["root"] / "store")
    req = urllib.request.Request(f"{hub.local_url}/api/next?device=d1", headers={"Authorization": "Bearer token-of-d2"})
    with pytest.raises(urllib.error.HTTPError) as err:  # another device's token: not d1's page
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 403 and b"d2's, not d1's" in err.value.read()
    req = urllib.request.Request(f"{hub.local_url}/ctl/d1/call", data=json.dumps({"op": "hello"}).encode(),
                                 method="POST", headers={"X-Farm-Hub-Key": "not-the-key"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 403


def test_a_page_killed_mid_command_is_reported_lost(farm):
    """Last in the module: it kills the page."""
    hub = farm["hub"]
    model = farm["root"] / "builds" / "current" / "models" / "tiny"
    with engine.load_pipeline(model, precision="fp32", executor="browser", session=HubPage(hub.control_url("d1"))) as page:
        ex = page.plan_executor(64, 64, guidance_scale=7.5)
        killer = subprocess.Popen(["sh", "-c", f"sleep 2; kill -9 {farm['proc'].pid}"])
        t0 = time.monotonic()
        with pytest.raises(BrowserError) as err:
            ex.time_stage("unet_step", repetitions=100000, warmup=0)
        killer.wait()
    assert err.value.kind == "page-lost", err.value
    assert time.monotonic() - t0 < 30.0
