"""The adb transport against the virtual phone: device info, resumable deploys (nothing partial
ever at a final path; a cut inside a file resumed from its last whole chunk, a build without
chunk hashes a whole file at a time), a generate job end to end with byte-identical artifacts, an agent
killed mid-job, busy devices, refused RSA keys, phones that stop answering, and bundles
signed with another key. A small TCP proxy between transport and phone cuts or freezes the
connection where a test needs it."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from net_support import PartialWatcher, Proxy, without_chunks

from agent.bundle import generate_keypair
from agent.packing import build_bundle
from agent.protocol import JobSpec, Manifest
from agent.simulator import VirtualPhone
from orchestrator.transports import (
    BundleRefused,
    DeviceBusy,
    DeviceOffline,
    DeviceTimeout,
    DeviceUnauthorized,
    InfraFailure,
    TransportError,
)
from orchestrator.transports.adb import DEFAULT_ROOT, AdbTransport, load_or_create_adb_key

DEVICE_ROOT = DEFAULT_ROOT.lstrip("/")
CHUNK = 64 << 10  # the chunked build's chunks: the tiny model's weights have 3, 69 and 16 of them


@pytest.fixture(scope="module")
def farm(tmp_path_factory, tiny_model_dir):
    """The farm's signing key and a bundle of the tiny model plus a few small files; a second
    bundle of the same files signed with another key."""
    tmp = tmp_path_factory.mktemp("farm")
    extra = tmp / "extra"
    (extra / "profiles").mkdir(parents=True)
    (extra / "profiles/test.json").write_text('{"rules": []}\n')
    (extra / "VERSION").write_text("0.1.0\n")
    key = generate_keypair(tmp / "farm.key", tmp / "farm.pub")
    sources = {"models/tiny": tiny_model_dir, "profiles": extra / "profiles", "VERSION": extra / "VERSION"}
    manifest = build_bundle(sources, tmp / "bundle", "b1", "0.1.0", key)
    rogue = generate_keypair(tmp / "rogue.key", tmp / "rogue.pub")
    build_bundle(sources, tmp / "rogue-bundle", "b1", "0.1.0", rogue)
    chunked = build_bundle(sources, tmp / "chunked", "b2", "0.1.0", key, chunk_size=CHUNK)
    return {"bundle": tmp / "bundle", "rogue": tmp / "rogue-bundle", "pub": tmp / "farm.pub", "manifest": manifest,
            "chunked": tmp / "chunked", "chunked_manifest": chunked,
            "unchunked": without_chunks(tmp / "bundle", tmp / "unchunked", tmp / "farm.key")}


def provision(phone: VirtualPhone, farm: dict) -> Path:
    """farm.pub into the device root inside the phone's sandbox; returns the root's host path."""
    root = phone.root / "fs" / DEVICE_ROOT
    root.mkdir(parents=True, exist_ok=True)
    (root / "farm.pub").write_bytes(farm["pub"].read_bytes())
    return root


@pytest.fixture
def phone(tmp_path, farm):
    """A phone paired with this test's transport key, as a farm's phones are with its host."""
    key = load_or_create_adb_key(tmp_path / "keys" / "adbkey")
    with VirtualPhone(serial="sim-transport", root=tmp_path / "phone", adb_keys=key.with_name(key.name + ".pub")) as p:
        p.device_root = provision(p, farm)
        yield p


def transport(port: int, tmp_path: Path, **kw) -> AdbTransport:
    return AdbTransport("127.0.0.1", port, key_path=tmp_path / "keys" / "adbkey", **kw)


@pytest.fixture
def adb(phone, tmp_path):
    t = transport(phone.port, tmp_path)
    yield t
    t.close()


def distinct_bytes(manifest: Manifest) -> int:
    return sum({f.sha256: f.size for f in manifest.files}.values())


def job(job_id: str, **kw) -> JobSpec:
    return JobSpec(**({"job_id": job_id, "kind": "generate", "model": "models/tiny", "precision": "fp32",
                       "steps": 2, "scheduler": "euler", "time_limit_s": 120.0} | kw))


# ---- info ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_info_reports_the_phone_and_its_adapter(adb, phone, tmp_path):
    t0 = time.monotonic()
    info = adb.info()
    print(f"info: {time.monotonic() - t0:.2f} s")
    assert (info.serial, info.model, info.os, info.virtual) == ("sim-transport", "Virtual Pixel 7", "android", True)
    assert info.adapter.get("device") and info.agent_version
    assert info.thermal and info.battery is not None  # (the virtual phone has no /proc/meminfo)
    # the host key was made on first use, private part 0600
    key = tmp_path / "keys" / "adbkey"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.with_name("adbkey.pub").is_file()


# ---- deploys -----------------------------------------------------------------------------------


def test_send_bundle_then_nothing_to_send(adb, phone, farm):
    manifest = farm["manifest"]
    events = []
    first = adb.send_bundle(farm["bundle"], progress=events.append)
    assert first.installed and first.bytes_sent == distinct_bytes(manifest)
    assert first.files_sent + first.files_skipped == len(manifest.files)
    assert events[-1] == {"event": "bundle_installed", "build": "b1"}
    assert any(e["event"] == "push" for e in events)
    root = phone.device_root
    assert (root / "builds/current/manifest.json").read_bytes() == (farm["bundle"] / "manifest.json").read_bytes()
    assert not (root / "incoming/b1").exists() and not (root / "incoming/.partial").exists()
    second = adb.send_bundle(farm["bundle"])
    assert (second.bytes_sent, second.files_sent, second.installed) == (0, 0, False)
    assert second.files_skipped == len(manifest.files)
    print(f"first send {first.seconds:.2f} s ({first.bytes_sent} bytes), second {second.seconds:.3f} s")


def damage_in_place(path: Path) -> None:
    """One byte flipped, the size kept: what a bad block or a stray write leaves."""
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(bytes(data))


def test_a_blob_damaged_on_the_phone_is_sent_again_and_the_build_repaired(adb, phone, farm):
    manifest = farm["manifest"]
    adb.send_bundle(farm["bundle"])
    biggest = max(manifest.files, key=lambda f: f.size)
    damage_in_place(phone.device_root / "store" / biggest.sha256[:2] / biggest.sha256)
    _, _, code = adb.shell(f"{adb.agent} verify --root {adb.root}")
    assert code != 0  # the agent finds the installed build damaged
    again = adb.send_bundle(farm["bundle"])  # by size, nothing was sent and the build stayed damaged
    assert (again.installed, again.files_sent, again.bytes_sent) == (True, 1, biggest.size)
    out, err, code = adb.shell(f"{adb.agent} verify --root {adb.root}")
    assert code == 0, out + err
    assert adb.send_bundle(farm["bundle"]).files_sent == 0


def test_a_build_without_chunk_hashes_cut_resumes_a_whole_file_at_a_time(phone, farm, tmp_path):
    """A connection cut halfway through a deploy of a build signed before manifests listed chunk
    hashes: no half-sent file lies at a final path, and the next deploy sends exactly the files
    that had not arrived whole."""
    manifest = farm["manifest"]
    total = distinct_bytes(manifest)
    proxy = Proxy(phone.port, cut_after=total // 2)
    try:
        with PartialWatcher(phone.device_root, manifest) as seen_partial:
            cut = transport(proxy.port, tmp_path)
            with pytest.raises(DeviceOffline, match="connection lost|closed"):
                cut.send_bundle(farm["unchunked"])
            cut.close()
            staged = sum(p.stat().st_size for p in (phone.device_root / "incoming/b1/files").rglob("*")
                         if p.is_file())
            assert 0 < staged < total
            assert not (phone.device_root / "builds").exists()
            resumed = transport(phone.port, tmp_path)
            report = resumed.send_bundle(farm["unchunked"])
            resumed.close()
    finally:
        proxy.close()
    assert report.installed and report.bytes_sent == total - staged, (report, staged, total)
    assert report.files_skipped > 0
    assert not seen_partial, seen_partial[:3]
    assert (phone.device_root / "builds/current/manifest.json").is_file()


def wire_bytes(bundle: Path, port: int, tmp_path: Path, cut_after: int | None = None) -> tuple[int, object]:
    """Bytes sent towards the phone for one deploy of `bundle` (through a proxy that cuts after
    `cut_after` of them), and its SendReport or the error it ended with."""
    proxy = Proxy(port, cut_after=cut_after)
    try:
        with transport(proxy.port, tmp_path) as t:
            try:
                outcome = t.send_bundle(bundle)
            except DeviceOffline as exc:
                outcome = exc
    finally:
        proxy.close()
    return proxy.forwarded, outcome


@pytest.mark.parametrize("fraction", [0.02, 0.5, 0.95])
def test_a_deploy_cut_inside_a_file_resumes_from_its_last_whole_chunk(tmp_path, farm, fraction):
    """A build whose manifest lists 64 KiB chunks, cut at 2 %, 50 % and 95 % of its bytes: on
    the wire, the cut deploy and the resumed one together send at most one chunk more than one
    uncut deploy does (plus one more deploy's start: its connection, the signed manifest again,
    the questions of what is there); the resumed deploy's bytes_sent is what it sent; nothing
    half-written is ever at a final path; the build installs and verifies."""
    manifest, bundle = farm["chunked_manifest"], farm["chunked"]
    total = distinct_bytes(manifest)
    key = load_or_create_adb_key(tmp_path / "keys" / "adbkey")
    start = len((bundle / "manifest.json").read_bytes()) + len((bundle / "manifest.sig").read_bytes()) + (8 << 10)
    with VirtualPhone(serial="sim-clean", root=tmp_path / "clean", adb_keys=key.with_name("adbkey.pub")) as clean:
        provision(clean, farm)
        uncut, report = wire_bytes(bundle, clean.port, tmp_path)
        assert report.installed and report.bytes_sent == total
    with VirtualPhone(serial="sim-cut", root=tmp_path / "phone", adb_keys=key.with_name("adbkey.pub")) as phone:
        root = provision(phone, farm)
        with PartialWatcher(root, manifest) as seen_partial:
            before, error = wire_bytes(bundle, phone.port, tmp_path, cut_after=int(total * fraction))
            assert isinstance(error, DeviceOffline) and not (root / "builds").exists()
            after, report = wire_bytes(bundle, phone.port, tmp_path)
        with transport(phone.port, tmp_path) as check:
            intact = check.installed_manifest_is((bundle / "manifest.json").read_bytes(), manifest)
    assert report.installed and intact and not seen_partial, (report, seen_partial[:3])
    assert before + after - uncut <= CHUNK + start, (before, after, uncut)
    assert after - report.bytes_sent <= uncut - total + start, (after, report)  # bytes_sent is not understated
    assert not list((root / "incoming/.resume").iterdir()), "a chunk or partial upload was left behind"


def test_bundle_signed_with_another_key_is_refused_naming_the_file(adb, phone, farm):
    with pytest.raises(BundleRefused, match=r"manifest\.json: manifest signature does not verify") as err:
        adb.send_bundle(farm["rogue"])
    assert err.value.state == "ready"
    assert not (phone.device_root / "builds").exists()
    assert adb.send_bundle(farm["bundle"]).installed  # the right bundle still goes through


# ---- jobs ------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_generate_job_end_to_end_with_identical_artifacts(adb, phone, farm, tmp_path):
    adb.send_bundle(farm["bundle"])
    events = []
    t0 = time.monotonic()
    result = adb.run(job("e2e", prompt="a red bicycle", seed=3), tmp_path / "out", progress=events.append)
    print(f"generate job over adb: {time.monotonic() - t0:.2f} s")
    assert result.status == "succeeded", result.error + result.log_tail
    image = next(a for a in result.artifacts if a.kind == "image")
    local = (tmp_path / "out" / image.path).read_bytes()
    on_device = (phone.device_root / "jobs/e2e" / image.path).read_bytes()
    assert hashlib.sha256(local).hexdigest() == image.sha256 and local == on_device
    assert (tmp_path / "out/job.log").is_file() and (tmp_path / "out/result.json").is_file()
    kinds = [e["event"] for e in events]
    assert kinds[0] == "started" and "step" in kinds and kinds[-1] == "finished"


def test_busy_device_raises_device_busy(adb, phone):
    locks = phone.device_root / "locks"
    locks.mkdir(parents=True)
    (locks / "device.lock").write_text(json.dumps({"job_id": "other", "pid": os.getpid(), "host": socket.gethostname(),
                                                   "started_at": time.time(), "time_limit_s": 60.0}))
    with pytest.raises(DeviceBusy, match="busy with job 'other'") as err:
        adb.run(job("b"), Path("/nonexistent-out"))
    assert err.value.state == "busy"


def test_a_service_the_phone_refuses_is_a_transport_error_and_the_connection_stays(adb, phone, monkeypatch):
    """A phone without the sync service answers its OPEN with CLSE: the push fails at once as
    the transport's own error (the worker records infra_failed, not a job failure), and the same
    connection still runs the next command."""
    from agent.simulator.device import Connection

    serve = Connection._service
    monkeypatch.setattr(Connection, "_service", lambda self, service: None if service.startswith("sync") else
                        serve(self, service))
    with pytest.raises(TransportError, match="push /data/local/tmp/x: the device refused the service sync") as err:
        adb.push(b"x", "/data/local/tmp/x")
    assert type(err.value) is TransportError
    assert adb.shell("echo still here")[0] == "still here\n"


@pytest.mark.gpu
def test_agent_killed_mid_job_is_infra_failure_and_the_next_job_runs(adb, phone, farm, tmp_path):
    adb.send_bundle(farm["bundle"])
    lock = phone.device_root / "locks/device.lock"
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = adb.run(job("doomed", steps=50), tmp_path / "doomed")
        except Exception as exc:  # checked below
            box["error"] = exc

    runner = threading.Thread(target=run)
    runner.start()
    deadline = time.monotonic() + 60
    record = {}
    while time.monotonic() < deadline and not record.get("child_pid"):
        try:
            record = json.loads(lock.read_text())
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    assert record.get("child_pid"), "the job never started"
    time.sleep(0.5)
    os.kill(record["pid"], signal.SIGKILL)  # the agent dies (OOM killer, crash); its child is orphaned
    runner.join(60)
    error = box.get("error")
    assert isinstance(error, InfraFailure), box
    assert "signal 9" in str(error) and "job doomed (generate)" in error.log_tail
    t0 = time.monotonic()
    while True:  # the orphaned child dies at its next progress write; then the lock is stale
        try:
            result = adb.run(job("after"), tmp_path / "after")
            break
        except DeviceBusy:
            assert time.monotonic() - t0 < 30, "the device lock was never released"
            time.sleep(0.5)
    print(f"next job ran {time.monotonic() - t0:.2f} s after the kill was reported")
    assert result.status == "succeeded", result.error
    assert "recovered stale lock of job 'doomed'" in (tmp_path / "after/job.log").read_text()


# ---- authentication and unresponsive phones ----------------------------------------------------------


def test_unknown_key_on_a_phone_that_refuses_new_keys_is_unauthorized(tmp_path, farm):
    with VirtualPhone(serial="locked", root=tmp_path / "locked", auth=True, accept_new_keys=False) as p:
        t = transport(p.port, tmp_path, auth_timeout_s=1.0, timeout_s=5.0)
        t0 = time.monotonic()
        with pytest.raises(DeviceUnauthorized, match="tap 'Allow'") as err:
            t.shell("echo hi")
        assert time.monotonic() - t0 < 4 and err.value.state == "unauthorized"
    # a phone that accepts the key (the user tapped Allow) lets the same transport in
    with VirtualPhone(serial="open", root=tmp_path / "open", auth=True, accept_new_keys=True) as p:
        t = transport(p.port, tmp_path)
        assert t.shell("echo hi") == ("hi\n", "", 0)
        t.close()
        assert (tmp_path / "keys/adbkey.pub").read_text().split()[0] == (p.root / "adb_keys").read_text().split()[0]


def test_a_phone_given_adb_keys_lets_in_only_those_hosts(tmp_path):
    """`farm-agent simulate --auth --adb-keys FILE`, as the compose stack runs it: the worker's
    public key (published read-only) is the only way in; a stranger offering its key is refused
    and nothing is written."""
    worker = load_or_create_adb_key(tmp_path / "worker" / "adbkey")
    public = tmp_path / "public" / "adbkey.pub"
    public.parent.mkdir()
    public.write_bytes(worker.with_name("adbkey.pub").read_bytes())
    public.chmod(0o444)
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "simulate", "--port", "0", "--serial", "locked",
                             "--root", str(tmp_path / "phone"), "--auth", "--adb-keys", str(public)],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, line
        port = int(line.split("127.0.0.1:")[1].split()[0])
        stranger = AdbTransport("127.0.0.1", port, key_path=tmp_path / "stranger" / "adbkey", auth_timeout_s=1.0,
                                timeout_s=5.0)
        with pytest.raises(DeviceUnauthorized):
            stranger.shell("echo hi")
        ok = AdbTransport("127.0.0.1", port, key_path=worker)
        assert ok.shell("echo hi") == ("hi\n", "", 0)
        ok.close()
        assert public.read_bytes() == worker.with_name("adbkey.pub").read_bytes()
        assert not (tmp_path / "phone" / "adb_keys").exists()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_workers_adb_transport_signs_with_the_config_dirs_key(tmp_path, monkeypatch):
    """A worker's adb devices are reached with <config_dir>/adbkey, the key `farm secrets
    public-keys` publishes and the stack's phones trust, whatever HOME is."""
    from orchestrator.infra.settings import Settings
    from orchestrator.store.models import Device
    from orchestrator.transports.factory import make_transport

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config")
    key = load_or_create_adb_key(settings.adb_key)
    with VirtualPhone(serial="paired", root=tmp_path / "phone", adb_keys=key.with_name("adbkey.pub")) as p:
        t = make_transport(Device(serial="paired", transport="adb", address=f"127.0.0.1:{p.port}"), settings)
        assert t.key_path == tmp_path / "config" / "adbkey"
        assert t.shell("echo hi") == ("hi\n", "", 0)
        t.close()
    assert not (tmp_path / "home").exists()


def test_adb_keys_without_auth_is_refused(tmp_path):
    done = subprocess.run([sys.executable, "-m", "agent.cli", "simulate", "--port", "0", "--serial", "x",
                           "--no-auth", "--adb-keys", str(tmp_path / "keys")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"--adb-keys {tmp_path / 'keys'} needs --auth" in done.stderr


def test_refuses_a_key_file_others_can_read(tmp_path, phone):
    t = transport(phone.port, tmp_path)
    t.shell("true")
    t.close()
    os.chmod(tmp_path / "keys/adbkey", 0o644)
    with pytest.raises(Exception, match="chmod 600"):
        transport(phone.port, tmp_path).shell("true")


def test_closed_port_is_offline(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DeviceOffline) as err:
        transport(port, tmp_path).info()
    assert err.value.state == "offline" and f"127.0.0.1:{port}" in str(err.value)


def test_silent_listener_times_out_within_the_timeout(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does), never answers
    try:
        t0 = time.monotonic()
        with pytest.raises(DeviceTimeout):
            transport(server.getsockname()[1], tmp_path, timeout_s=1.0).shell("true")
        assert time.monotonic() - t0 < 3
    finally:
        server.close()


def test_phone_that_stops_answering_mid_session_times_out(phone, farm, tmp_path):
    proxy = Proxy(phone.port)
    t = transport(proxy.port, tmp_path, timeout_s=1.0)
    try:
        assert t.shell("echo hi")[0] == "hi\n"
        proxy.freeze()
        t0 = time.monotonic()
        with pytest.raises((DeviceTimeout, DeviceOffline)) as err:
            t.send_bundle(farm["bundle"])
        elapsed = time.monotonic() - t0
        assert elapsed < 3, elapsed
        assert isinstance(err.value, DeviceTimeout) and err.value.state == "unresponsive"
    finally:
        proxy.close()
        t.close()


def test_a_message_larger_than_the_socket_buffer_is_sent_whole():
    """adb-shell sends once on a non-blocking socket; a reader slower than the sender must still
    get every byte (the transport loops until all of a message is sent)."""
    from orchestrator.transports.adb import NoDelayTcpTransport

    listener = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def slow_reader() -> None:
        conn, _ = listener.accept()
        with conn:
            while chunk := conn.recv(65536):
                received.extend(chunk)

    reader = threading.Thread(target=slow_reader, daemon=True)
    reader.start()
    t = NoDelayTcpTransport("127.0.0.1", listener.getsockname()[1])
    t.connect(5.0)
    t.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    data = os.urandom(2**20)  # far more than one send() on a 4 KiB buffer takes
    assert t.bulk_write(data, 5.0) == len(data)
    t.close()
    reader.join(timeout=30)
    listener.close()
    assert bytes(received) == data


def test_stop_job_kills_the_running_job_and_only_that_one(adb, phone):
    from stop_support import check_stop_job

    check_stop_job(adb, phone.device_root)
