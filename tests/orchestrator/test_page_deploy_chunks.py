"""The farm page's deploy a chunk at a time (agent/web/farm.js) in Debian's headless Chromium on
SwiftShader, through the real hub (orchestrator/transports/hub.py) serving byte ranges of a build
made with 64 KiB chunks (the tiny UNet file is 69 of them): a deploy cut at about 2%, 50% and 95%
of the build's bytes (the hub closes the connection mid-chunk) is resumed by the next deploy
fetching exactly the chunks not held, and the build then generates; no buffer the deploy fills
is larger than a chunk; an unchanged re-deploy fetches nothing; a third build makes the page
drop the first one's manifest and chunks, and say how many bytes it freed; a chunk damaged in
the page's cache (through Chromium's DevTools protocol) is found by the run that reads it, dropped
and fetched again by the next deploy; the browser transport passes the page's chunk, freed and
storage fields on in its deploy event."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import os
import re
import select
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from ci_support import missing
from cryptography.hazmat.primitives import serialization

import engine
import orchestrator.transports.hub as browser_hub
from agent.bundle import generate_keypair, load_private_key, load_public_key, provision_public_key
from agent.hubpage import HubPage
from agent.packing import build_bundle
from agent.protocol import FILES, Manifest, from_json
from engine.browser import chromium_command, find_chromium
from engine.errors import BrowserError
from engine.kernels import SHADER_ROOT
from orchestrator.transports.browser import BrowserTransport, WebPageLink
from orchestrator.transports.hub import BrowserHub
from orchestrator.transports.local import LocalTransport

pytestmark = pytest.mark.gpu

TOKEN = "t0k3n-of-the-chunked-device"
CHUNK = 64 << 10
BIG = 128 << 20
UNET = "models/tiny/unet/diffusion_pytorch_model.safetensors"


def page_files(manifest: Manifest) -> list:
    return [f for f in manifest.files if f.path.startswith("shaders/") or f.path.endswith(".safetensors")]


def deploy_fields(bundle: Path) -> dict:
    manifest = from_json(Manifest, (bundle / "manifest.json").read_bytes())
    return {"build": manifest.build, "manifest_b64": base64.b64encode(manifest.canonical_bytes()).decode(),
            "signature_b64": base64.b64encode((bundle / "manifest.sig").read_bytes()).decode(),
            "files": [f.path for f in page_files(manifest)]}


class Blobs:
    """Stands in for the hub's send_file on /blobs: records every byte range served whole, and,
    while `cut_after` is set, closes the connection once that many more bytes went out, mid-body
    (a network cut)."""

    def __init__(self, send_file):
        self.send_file, self.lock = send_file, threading.Lock()
        self.served, self.whole = 0, []  # body bytes sent; (sha256, start, end) ranges sent whole
        self.cut_after: int | None = None

    def __call__(self, handler, root: Path, rel: str | None = None) -> int:
        path, rng = Path(root) / rel, handler.headers.get("Range", "")
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", rng)
        size = path.stat().st_size
        start, end = (int(m[1]), min(int(m[2]), size - 1) + 1) if m else (0, size)
        with self.lock:
            budget = None if self.cut_after is None else self.cut_after - self.served
        if budget is not None and budget < end - start:
            body = path.read_bytes()[start:end]
            handler.send_response(206 if m else 200)
            handler.send_header("Content-Length", str(len(body)))
            if m:
                handler.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            handler.end_headers()
            handler.wfile.write(body[:budget])
            handler.wfile.flush()
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
            with self.lock:
                self.served += budget
                self.cut_after = None  # one cut
            return budget
        sent = self.send_file(handler, root, rel)
        with self.lock:
            self.served += sent
            self.whole.append((rel, start, start + sent))
        return sent


class DevTools:
    """Chromium's DevTools protocol over --remote-debugging-pipe: the browser reads commands on
    its fd 3 and writes answers on its fd 4, each a JSON text ended by a NUL byte."""

    def __init__(self):
        self._to_browser, self._to_us = os.pipe(), os.pipe()
        self._ids = itertools.count(1)
        self._pending = b""

    def child_fds(self) -> None:  # preexec_fn: the pipes become the browser's fds 3 and 4
        os.dup2(self._to_browser[0], 3)
        os.dup2(self._to_us[1], 4)

    def started(self) -> None:
        os.close(self._to_browser[0])
        os.close(self._to_us[1])

    def close(self) -> None:
        os.close(self._to_browser[1])
        os.close(self._to_us[0])

    def send(self, method: str, session: str | None = None, timeout_s: float = 60.0, **params) -> dict:
        command_id = next(self._ids)
        message = {"id": command_id, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._to_browser[1], json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" not in self._pending:
                if not select.select([self._to_us[0]], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    raise TimeoutError(f"no answer to {method} within {timeout_s} s")
                data = os.read(self._to_us[0], 1 << 16)
                if not data:
                    raise ConnectionError("the browser closed its DevTools pipe")
                self._pending += data
            raw, self._pending = self._pending.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == command_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, expression: str):
        """`expression`'s value (awaited) in the farm's page."""
        pages = [t for t in self.send("Target.getTargets")["targetInfos"]
                 if t["type"] == "page" and "/web/index.html" in t["url"]]
        session = self.send("Target.attachToTarget", targetId=pages[0]["targetId"], flatten=True)["sessionId"]
        result = self.send("Runtime.evaluate", session, expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"the page threw: {result['exceptionDetails']}")
        return result["result"].get("value")


@pytest.fixture(scope="module")
def farm(tmp_path_factory, tiny_model_dir):
    if not find_chromium():
        missing("no chromium: bash scripts/ensure-chromium.sh installs it", "CI needs it")
    tmp = tmp_path_factory.mktemp("chunks")
    key = generate_keypair(tmp / "farm.key", tmp / "farm.pub")
    rng = np.random.default_rng(7)
    for name in ("b1", "b2", "b3"):  # each build holds a weight file of its own (3.5 chunks)
        (tmp / f"own-{name}").mkdir()
        (tmp / f"own-{name}" / "own.safetensors").write_bytes(rng.bytes(CHUNK * 7 // 2))
        build_bundle({"models/tiny": tiny_model_dir, "shaders": SHADER_ROOT, f"models/{name}": tmp / f"own-{name}"},
                     tmp / name, name, "0.1.0", key, chunk_size=CHUNK)
    (tmp / "own-big").mkdir()  # one file of 128 chunks of 1 MiB
    (tmp / "own-big" / "big.safetensors").write_bytes(rng.bytes(BIG))
    build_bundle({"models/big": tmp / "own-big"}, tmp / "big", "big", "0.1.0", key, chunk_size=1 << 20)
    root = tmp / "root"
    provision_public_key(root, tmp / "farm.pub")
    LocalTransport(root).send_bundle(tmp / "b1")  # the host side of the device holds build b1
    store = tmp / "store"  # every build's blobs, served to the page by sha256
    for name in ("b1", "b2", "b3", "big"):
        for f in from_json(Manifest, (tmp / name / "manifest.json").read_bytes()).files:
            (store / f.sha256[:2]).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tmp / name / FILES / f.path, store / f.sha256[:2] / f.sha256)
    hub = BrowserHub(page_lost_s=6.0, poll_s=4.0)
    hub.register("d1", TOKEN, store)
    yield {"hub": hub, "root": root, "tmp": tmp, "store": store}
    hub.close()


@pytest.fixture
def page(farm, monkeypatch):
    """A fresh page (its own Chromium profile: an empty cache) and the hub's blob accounting."""
    blobs = Blobs(browser_hub.send_file)
    monkeypatch.setattr(browser_hub, "send_file", blobs)
    raw = load_public_key(farm["tmp"] / "farm.pub").public_bytes(serialization.Encoding.Raw,
                                                                 serialization.PublicFormat.Raw)
    key = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    profile = tempfile.mkdtemp(prefix="chunks-chromium-")
    url = f"{farm['hub'].local_url}/web/index.html#device=d1&token={TOKEN}&key={key}"
    log = open(Path(profile) / "chromium.log", "wb")  # noqa: SIM115
    devtools = DevTools()
    command = chromium_command(find_chromium(), profile, url, "swiftshader")
    proc = subprocess.Popen([*command[:-1], "--remote-debugging-pipe", command[-1]], stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=devtools.child_fds,
                            pass_fds=(3, 4))
    devtools.started()
    blobs.devtools = devtools
    try:
        farm["hub"].wait_online("d1", 60.0)  # (the last test's page may still count as online)
        farm["hub"].call("d1", "hello", timeout_s=60.0)  # this page: the last one is gone
        blobs.chromium = proc.pid
        yield blobs
    finally:
        proc.kill()
        proc.wait()
        devtools.close()
        log.close()
        shutil.rmtree(profile, ignore_errors=True)


def deploy(farm, name: str) -> dict:
    return farm["hub"].call("d1", "deploy", timeout_s=180, **deploy_fields(farm["tmp"] / name))


def build_bytes(farm, name: str) -> int:
    return sum({f.sha256: f.size for f in page_files(from_json(Manifest, (farm["tmp"] / name /
                                                                          "manifest.json").read_bytes()))}.values())


@pytest.mark.parametrize("fraction", [0.02, 0.5, 0.95])
def test_a_cut_deploy_resumes_with_the_chunks_not_held(farm, page, fraction):
    total = build_bytes(farm, "b1")
    page.cut_after = int(total * fraction)
    with pytest.raises(BrowserError) as err:
        deploy(farm, "b1")
    assert err.value.kind == "weight-fetch", err.value
    cut, held = page.served, list(page.whole)
    held_bytes = sum(end - start for _, start, end in held)
    assert cut == int(total * fraction) and cut - held_bytes < CHUNK  # the cut cost the chunk in flight only
    page.whole.clear()
    resumed = deploy(farm, "b1")
    assert resumed["fetched_bytes"] == page.served - cut == total - held_bytes
    assert not set(held) & set(page.whole)  # no chunk held before the cut came again
    assert resumed["fetched_chunks"] == len(page.whole) and resumed["largest_buffer"] <= CHUNK
    print(f"cut at {fraction:.0%} of {total} bytes ({cut} served, {held_bytes} held in {len(held)} requests): "
          f"the resume fetched {resumed['fetched_bytes']} bytes in {resumed['fetched_chunks']} chunks")
    again = deploy(farm, "b1")
    assert (again["fetched_bytes"], again["fetched_files"], again["fetched_chunks"]) == (0, 0, 0)
    assert again["held_files"] == len(deploy_fields(farm["tmp"] / "b1")["files"])
    if fraction != 0.5:
        return
    model = farm["root"] / "builds" / "current" / "models" / "tiny"  # b1, from the resumed page cache
    args = {"prompt": "a red bicycle", "steps": 2, "scheduler": "euler", "seed": 4, "height": 64, "width": 64}
    served = page.served
    hub = farm["hub"]
    with engine.load_pipeline(model, precision="fp32", executor="browser", session=HubPage(hub.control_url("d1"))) as p:
        image = p.generate(**args).image
    with engine.load_pipeline(model, precision="fp32", executor="plan") as plan:
        reference = plan.generate(**args).image
    assert page.served == served  # the weights came from the chunks in the page's cache
    mse = np.mean((image.astype(np.float64) - reference.astype(np.float64)) ** 2)
    assert 10 * np.log10(255.0**2 / max(mse, 1e-12)) >= 40.0


def test_a_deploy_holds_a_chunk_at_a_time_and_keeps_two_builds(farm, page):
    manifest = from_json(Manifest, (farm["tmp"] / "b1" / "manifest.json").read_bytes())
    unet = next(f for f in manifest.files if f.path == UNET)
    assert len(unet.chunks) > 60  # a file of many chunks, never one buffer
    first = deploy(farm, "b1")
    assert first["fetched_bytes"] == build_bytes(farm, "b1") == page.served
    assert first["fetched_chunks"] == sum(len(f.chunks) for f in page_files(manifest))
    assert 0 < first["largest_buffer"] <= CHUNK < unet.size
    assert isinstance(first["persisted"], bool) and first["quota_bytes"] > first["usage_bytes"] > 0
    assert (first["kept_builds"], first["freed_bytes"]) == (["b1"], 0)
    second = deploy(farm, "b2")  # b2 shares everything but its own file with b1
    own = {name: next(f for f in from_json(Manifest, (farm["tmp"] / name / "manifest.json").read_bytes()).files
                      if f.path == f"models/{name}/own.safetensors") for name in ("b1", "b2", "b3")}
    assert second["fetched_bytes"] == own["b2"].size and second["fetched_chunks"] == 4
    assert (second["kept_builds"], second["freed_bytes"]) == (["b1", "b2"], 0)
    third = deploy(farm, "b3")  # b1 goes: its own file and its manifest, nothing b2 or b3 lists
    b1_record = len(base64.b64decode(deploy_fields(farm["tmp"] / "b1")["manifest_b64"])) + \
        (farm["tmp"] / "b1" / "manifest.sig").stat().st_size
    assert third["kept_builds"] == ["b2", "b3"]
    assert third["freed_bytes"] == own["b1"].size + b1_record
    print(f"largest buffer {first['largest_buffer']} bytes; persisted {first['persisted']}; "
          f"quota {first['quota_bytes']}, usage {first['usage_bytes']}; b3 freed {third['freed_bytes']} bytes")
    with pytest.raises(BrowserError, match="not deployed"):  # b1's manifest is gone from the page
        with engine.load_pipeline(farm["root"] / "builds" / "current" / "models" / "tiny", precision="fp32",
                                  executor="browser", session=HubPage(farm["hub"].control_url("d1"))) as p:
            p.generate(prompt="x", steps=1, scheduler="euler", seed=1, height=64, width=64)
    page.whole.clear()
    back = deploy(farm, "b1")  # a rollback to b1 fetches only its own file again
    assert back["fetched_bytes"] == own["b1"].size and back["kept_builds"] == ["b3", "b1"]
    assert back["freed_bytes"] == own["b2"].size + len(base64.b64decode(deploy_fields(farm["tmp"] / "b2")
                                                                          ["manifest_b64"])) + \
        (farm["tmp"] / "b2" / "manifest.sig").stat().st_size


def damage_chunk(page, entry, i: int) -> int:
    """Flips a byte of chunk i of `entry` in the page's cache, keeping the entry's size and headers
    (the digest it was stored with): a flash cell gone bad, not a chunk the deploy never finished."""
    return page.devtools.evaluate(f"""(async () => {{
        const cache = await caches.open("devicefarm-builds-v1");
        const key = new URL("/chunk-cache/{entry.sha256}/{CHUNK}/{i}", location.href).href;
        const hit = await cache.match(key);
        const bytes = new Uint8Array(await hit.arrayBuffer());
        bytes[100] ^= 0xff;
        await cache.put(key, new Response(bytes, {{ headers: hit.headers }}));
        return bytes.length;
    }})()""")


def test_a_damaged_chunk_is_dropped_by_the_run_that_reads_it_and_fetched_again_by_the_next_deploy(farm, page):
    """An unchanged re-deploy reads no held chunk (each is trusted by its size and the digest it
    was stored with): a chunk damaged since is found by the run that reads it, which fails naming
    it and drops it, and the next deploy fetches that one chunk again. A deploy with verify hashes
    every held chunk again and fetches a damaged one at once."""
    manifest = from_json(Manifest, (farm["tmp"] / "b1" / "manifest.json").read_bytes())
    unet = next(f for f in manifest.files if f.path == UNET)
    deploy(farm, "b1")
    assert damage_chunk(page, unet, 5) == CHUNK
    page.whole.clear()
    assert deploy(farm, "b1")["fetched_chunks"] == 0  # trusted: nothing read, nothing fetched
    model = farm["root"] / "builds" / "current" / "models" / "tiny"
    args = {"prompt": "a red bicycle", "steps": 1, "scheduler": "euler", "seed": 4, "height": 64, "width": 64}
    session = HubPage(farm["hub"].control_url("d1"))
    with pytest.raises(BrowserError) as damaged:
        with engine.load_pipeline(model, precision="fp32", executor="browser", session=session) as p:
            p.generate(**args)
    assert damaged.value.kind == "hash-mismatch"
    assert f"of the cached {UNET} are damaged: 1 chunk(s) dropped, deploy build b1 again" in str(damaged.value)
    again = deploy(farm, "b1")
    assert (again["fetched_chunks"], again["fetched_bytes"]) == (1, CHUNK)
    assert page.whole == [(unet.sha256, 5 * CHUNK, 6 * CHUNK)]
    with engine.load_pipeline(model, precision="fp32", executor="browser", session=session) as p:
        assert p.generate(**args).image.shape == (64, 64, 3)
    damage_chunk(page, unet, 17)
    page.whole.clear()
    verified = farm["hub"].call("d1", "deploy", timeout_s=180, verify=True, **deploy_fields(farm["tmp"] / "b1"))
    assert (verified["fetched_chunks"], verified["fetched_bytes"]) == (1, CHUNK)
    assert page.whole == [(unet.sha256, 17 * CHUNK, 18 * CHUNK)]


def test_a_manifest_without_chunks_is_deployed_whole_as_before(farm, page):
    """An older manifest (chunk_size 0, no chunk lists) is fetched a file at a time, without ranges."""
    manifest = from_json(Manifest, (farm["tmp"] / "b1" / "manifest.json").read_bytes())
    old = dataclasses.replace(manifest, build="old", chunk_size=0,
                              files=[dataclasses.replace(f, chunks=[]) for f in manifest.files])
    canonical = old.canonical_bytes()
    fields = {**deploy_fields(farm["tmp"] / "b1"), "build": "old", "manifest_b64": base64.b64encode(canonical).decode(),
              "signature_b64": base64.b64encode(load_private_key(farm["tmp"] / "farm.key").sign(canonical)).decode()}
    first = farm["hub"].call("d1", "deploy", timeout_s=180, **fields)
    files = page_files(manifest)
    assert (first["fetched_bytes"], first["fetched_chunks"], first["chunk_size"]) == (build_bytes(farm, "b1"), 0, 0)
    assert sorted(page.whole) == sorted({(f.sha256, 0, f.size) for f in files})  # whole files, no ranges
    again = farm["hub"].call("d1", "deploy", timeout_s=180, **fields)
    assert (again["fetched_bytes"], again["held_files"]) == (0, len(files))


def renderers(pid: int) -> list[int]:
    """The renderer processes among Chromium `pid`'s descendants."""
    children = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append((int(proc.name), cmdline))
    found, todo = [], [pid]
    while todo:
        for child, cmdline in children.get(todo.pop(), []):
            todo.append(child)
            if b"--type=renderer" in cmdline:
                found.append(child)
    return found


def status_kib(pid: int, field: str) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def test_the_pages_memory_grows_by_far_less_than_a_large_file_it_deploys(farm, page):
    """The page's renderer's peak resident memory (VmHWM, reset just before) grows by less than
    half of a 128 MiB file while the page deploys it. Measured with Chromium 156 on SwiftShader: a
    deploy reading the file whole grew it by 216 MB for 64 MiB; chunks read into one reused
    buffer by 33 MB for 16, 64 and 160 MiB alike (the page's own churn, not the file); a fresh
    buffer per chunk by 79 MB for 160 MiB (dead buffers waiting for the collector)."""
    pids = renderers(page.chromium)
    assert pids
    rss = {}
    for pid in pids:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        rss[pid] = status_kib(pid, "VmRSS")
    report = deploy(farm, "big")
    growth = max(status_kib(pid, "VmHWM") - rss[pid] for pid in pids) * 1024
    print(f"renderer peak RSS growth while deploying {BIG} bytes: {growth} bytes ({report.get('chunk_reader')})")
    assert report["fetched_bytes"] == BIG and report["largest_buffer"] <= 1 << 20
    assert growth < BIG // 2


def test_the_browser_transport_reports_the_pages_chunks_freed_bytes_and_storage(farm, page, tmp_path):
    hub = farm["hub"]
    transport = BrowserTransport(tmp_path / "root", WebPageLink(hub.local_url, "d1"), TOKEN, farm["tmp"] / "farm.pub",
                                 name="d1", hub=hub)  # serves the page from its own store
    try:
        events = []
        sent = transport.send_bundle(farm["tmp"] / "b1", events.append)
        (done,) = [e for e in events if e.get("where") == "page"]
        manifest = from_json(Manifest, (farm["tmp"] / "b1" / "manifest.json").read_bytes())
        assert done["event"] == "bundle_installed" and done["bytes"] == sent.bytes_sent == build_bytes(farm, "b1")
        assert (done["chunks"], done["chunk_size"]) == (sum(len(f.chunks) for f in page_files(manifest)), CHUNK)
        assert (done["freed_bytes"], done["kept_builds"]) == (0, ["b1"])
        assert isinstance(done["persisted"], bool) and done["quota_bytes"] > done["usage_bytes"] > 0
        events.clear()
        transport.send_bundle(farm["tmp"] / "b1", events.append)
        (done,) = [e for e in events if e.get("where") == "page"]
        assert (done["event"], done["bytes"], done["chunks"]) == ("bundle_current", 0, 0)
    finally:
        transport.close()
        hub.register("d1", TOKEN, farm["store"])


def test_a_kept_plan_is_reused_only_within_the_budget_of_the_load_that_asks_for_it(farm, page):
    """A plan loaded from a deployed build stays loaded between jobs; a later load of it under a
    budget its held memory exceeds does not reuse it: below the staged peak the page refuses it
    (over-budget, with the numbers) and above it loads the plan staged. Before, the kept runner
    was reused whatever the budget."""
    from engine.browser import BrowserExecutor
    from engine.fit import plan_memory

    deploy(farm, "b1")
    model = farm["root"] / "builds" / "current" / "models" / "tiny"
    session = HubPage(farm["hub"].control_url("d1"))
    with engine.load_pipeline(model, precision="fp32", executor="browser", session=session) as p:
        p.generate(prompt="x", steps=1, scheduler="euler", seed=1, height=64, width=64)
        (plan,) = p.plans.values()
    memory = plan_memory(plan)
    assert memory.staged_bytes < memory.resident_bytes
    again = BrowserExecutor(plan, model, session)
    assert again.load_report.get("reused") and again.residency == "resident"
    with pytest.raises(BrowserError) as refused:
        BrowserExecutor(plan, model, session, budget_bytes=memory.staged_bytes - 1)
    assert refused.value.kind == "over-budget"
    assert f"peak GPU memory {memory.staged_bytes:,} bytes (staged) > the budget of " \
           f"{memory.staged_bytes - 1:,}" in str(refused.value)
    staged = BrowserExecutor(plan, model, session, budget_bytes=memory.resident_bytes - 1)
    assert not staged.load_report.get("reused") and staged.residency == "staged"
