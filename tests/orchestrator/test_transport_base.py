"""What every transport does the same way (orchestrator/transports/base.py), on transports that
reach nothing real: the job time limit, the agent's exit codes, the JobResult checks, the
artifact fetch, and the deploy and job templates over a device kept in memory. The adb, http
and local transports' own tests run the same templates through real peers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from agent.protocol import (
    EXIT_BAD_INPUT,
    EXIT_BUSY,
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    Artifact,
    Cooldown,
    JobResult,
    JobSpec,
    to_json,
)
from orchestrator.transports.base import (
    AgentExit,
    BundleRefused,
    DeviceBusy,
    InfraFailure,
    ProtocolMismatch,
    Transport,
    TransportError,
)


def _unreachable(*_args, **_kw):
    raise AssertionError("a shared check reached for the device")


class Nowhere(Transport):
    name = "nowhere"
    job_margin_s = 7.0
    info = installed_manifest_is = prepare_deploy = push_file = push_signed = install = _unreachable
    exec_job = read_job_file = _unreachable


class InMemory(Transport):
    """A device kept in a dict: its store (sha256 -> bytes), its current manifest and what one
    `farm-agent run` leaves behind (exit, stdout, stderr lines, job files)."""

    name = "memory"

    def __init__(self, refuse: str | None = None):
        self.store: dict[str, bytes] = {}
        self.staged: dict[str, bytes] = {}
        self.current: bytes | None = None
        self.refuse = refuse
        self.exit = AgentExit(0)
        self.lines: list[str] = []
        self.files: dict[str, bytes] = {}
        self.calls: list[str] = []

    def info(self):
        raise NotImplementedError

    def installed_manifest_is(self, manifest_bytes, manifest):
        return self.current == manifest_bytes

    def prepare_deploy(self, manifest_bytes, manifest):
        return [f for f in manifest.files if f.sha256 not in self.store]

    def push_file(self, manifest, f, source, on_bytes):
        data = source.read_bytes()
        for i in range(0, len(data), 4):
            on_bytes(len(data[i:i + 4]))
        self.staged[f.sha256] = data

    def push_signed(self, manifest, bundle_dir):
        self.calls.append("signed")

    def install(self, manifest, allow_downgrade=False):
        if self.refuse:
            raise BundleRefused(self.name, self.refuse)
        self.store |= self.staged
        self.current = (self.bundle / "manifest.json").read_bytes()

    def exec_job(self, spec, limit_s, on_line, progress):
        self.calls.append(f"exec {spec.job_id} {limit_s:g}")
        for line in self.lines:
            on_line(line)
        return self.exit

    def read_job_file(self, spec, path):
        try:
            return self.files[path]
        except KeyError:
            raise FileNotFoundError(path) from None


SPEC = JobSpec(job_id="j1", kind="generate", model="models/tiny", time_limit_s=30.0)


def test_the_job_time_limit_adds_the_cool_down_and_the_margin():
    t = Nowhere()
    assert t.job_limit_s(SPEC) == 37.0
    cooled = JobSpec(job_id="j2", kind="latency", model="m", time_limit_s=30.0, cooldown=Cooldown(max_wait_s=60.0))
    assert t.job_limit_s(cooled) == 97.0


@pytest.mark.parametrize("code,error,words", [
    (EXIT_BUSY, DeviceBusy, "another job"),
    (EXIT_BAD_INPUT, ProtocolMismatch, "refused job j1"),
    (EXIT_NOT_FOUND, TransportError, "not installed"),
    (137, InfraFailure, "signal 9"),
    (3, InfraFailure, "exit code 3"),
])
def test_agent_exit_codes(code, error, words):
    tails = []
    with pytest.raises(error, match=words) as err:
        Nowhere().check_exit(SPEC, code, "error: another job holds the lock", lambda: tails.append(1) or "the log",
                             signal=9 if code == 137 else None)
    assert type(err.value) is error
    assert bool(tails) == (error is InfraFailure)  # the log is read only for an infrastructure failure
    if error is InfraFailure:
        assert "the log" in str(err.value)


@pytest.mark.parametrize("code", [0, EXIT_FAILED])
def test_results_are_not_errors(code):
    Nowhere().check_exit(SPEC, code, "", lambda: pytest.fail("no log wanted"))


def test_a_result_for_another_job_is_refused():
    result = JobResult(job_id="someone-else", kind="generate", status="succeeded")
    with pytest.raises(InfraFailure, match="asked for job j1, the agent answered for someone-else"):
        Nowhere().parse_result(SPEC, to_json(result))
    with pytest.raises(ProtocolMismatch, match="job j1"):
        Nowhere().parse_result(SPEC, json.dumps({"job_id": "j1"}))


def _artifact(path: str, data: bytes) -> Artifact:
    return Artifact(path=path, sha256=hashlib.sha256(data).hexdigest(), size=len(data))


def test_artifacts_are_checked_and_named_only_when_whole(tmp_path: Path):
    files = {"image.png": b"png bytes", "logs/job.log": b"log"}
    result = JobResult(job_id="j1", kind="generate", status="succeeded",
                       artifacts=[_artifact(p, d) for p, d in files.items()])
    Nowhere().fetch_artifacts(result, tmp_path / "out", lambda path, tmp: tmp.write_bytes(files[path]))
    assert (tmp_path / "out" / "logs" / "job.log").read_bytes() == b"log"
    assert json.loads((tmp_path / "out" / "result.json").read_text())["job_id"] == "j1"

    damaged = JobResult(job_id="j1", kind="generate", status="succeeded",
                        artifacts=[_artifact("image.png", b"other bytes")])
    with pytest.raises(InfraFailure, match="another sha256"):
        Nowhere().fetch_artifacts(damaged, tmp_path / "bad", lambda path, tmp: tmp.write_bytes(b"png bytes"))
    assert list((tmp_path / "bad").iterdir()) == []  # nothing half-fetched left under any name


@pytest.mark.parametrize("path", ["../escape.png", "/etc/passwd", "a/../../b"])
def test_an_artifact_path_out_of_the_job_folder_is_refused_before_any_fetch(tmp_path: Path, path):
    result = JobResult(job_id="j1", kind="generate", status="succeeded",
                       artifacts=[_artifact("fine.png", b"x"), _artifact(path, b"y")])
    fetched = []
    with pytest.raises(ProtocolMismatch, match="leaves the job folder"):
        Nowhere().fetch_artifacts(result, tmp_path, lambda p, tmp: fetched.append(p))
    assert fetched == []


def test_a_bundle_with_a_build_name_that_is_not_plain_is_refused(tmp_path: Path):
    (tmp_path / "manifest.json").write_text(json.dumps({"build": "../up", "version": "1", "files": []}))
    with pytest.raises(TransportError, match="is not a plain name|manifest"):
        Nowhere().read_manifest(tmp_path)


def _bundle(tmp_path: Path, files: dict[str, bytes], build: str = "b1") -> Path:
    from agent.protocol import Manifest, ManifestFile

    bundle = tmp_path / build
    for path, data in files.items():
        (bundle / "files" / path).parent.mkdir(parents=True, exist_ok=True)
        (bundle / "files" / path).write_bytes(data)
    manifest = Manifest(build=build, version="1", created=0.0,
                        files=[ManifestFile(p, hashlib.sha256(d).hexdigest(), len(d)) for p, d in files.items()])
    (bundle / "manifest.json").write_text(to_json(manifest))
    (bundle / "manifest.sig").write_bytes(b"sig")
    return bundle


def test_the_deploy_template_sends_what_is_lacking_once_and_reports_it(tmp_path: Path):
    device = InMemory()
    device.bundle = _bundle(tmp_path, {"a.bin": b"0123456789", "b/c.txt": b"abc"})
    events = []
    first = device.send_bundle(device.bundle, progress=events.append)
    assert (first.bytes_sent, first.files_sent, first.files_skipped, first.installed) == (13, 2, 0, True)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "bundle_plan" and kinds[-1] == "bundle_installed" and kinds.count("push") == 4
    assert events[0]["bytes"] == 13 and events[-2]["bytes_sent"] == events[-2]["bytes_total"] == 13
    again = []
    second = device.send_bundle(device.bundle, progress=again.append)
    assert (second.bytes_sent, second.files_skipped, second.installed) == (0, 2, False)
    assert [e["event"] for e in again] == ["bundle_current"]

    device.bundle = _bundle(tmp_path, {"a.bin": b"0123456789", "d.bin": b"new"}, build="b2")
    third = device.send_bundle(device.bundle)
    assert (third.bytes_sent, third.files_sent, third.files_skipped) == (3, 1, 1)  # only the new blob


def test_a_refused_install_is_reported_and_leaves_the_current_build(tmp_path: Path):
    device = InMemory(refuse="manifest.sig: bad signature")
    device.bundle = _bundle(tmp_path, {"a.bin": b"x"})
    with pytest.raises(BundleRefused, match="bad signature"):
        device.send_bundle(device.bundle)
    assert device.current is None


def _result_bytes(**kw) -> bytes:
    return to_json(JobResult(job_id="j1", kind="generate", status="succeeded", **kw)).encode()


def test_the_job_template_relays_events_reads_the_result_and_fetches_artifacts(tmp_path: Path):
    device = InMemory()
    device.lines = ['{"event": "step", "done": 1, "total": 2}', "a warning the agent printed"]
    device.files = {"result.json": _result_bytes(artifacts=[_artifact("image.png", b"png")]), "image.png": b"png"}
    events = []
    result = device.run(SPEC, tmp_path / "out", progress=events.append)
    assert result.status == "succeeded" and (tmp_path / "out" / "image.png").read_bytes() == b"png"
    assert events == [{"event": "step", "done": 1, "total": 2}]
    assert device.calls == ["exec j1 150"]  # the spec's 30 s and the transport's default 120 s margin

    device.exit = AgentExit(0, stdout=_result_bytes().decode())  # a result printed on stdout wins
    device.files = {}
    assert device.run(SPEC, tmp_path / "out2").job_id == "j1"


def test_a_job_that_ends_without_a_result_is_an_infrastructure_failure_with_the_log(tmp_path: Path):
    device = InMemory()
    device.files = {"job.log": b"x" * 5000 + b"the end of the log"}
    with pytest.raises(InfraFailure, match="without result.json") as err:
        device.run(SPEC, tmp_path / "out")
    assert err.value.log_tail.endswith("the end of the log") and len(err.value.log_tail) == 4000
    device.exit = AgentExit(137, signal=9)
    with pytest.raises(InfraFailure, match="signal 9"):
        device.run(SPEC, tmp_path / "out")
    device.exit, device.lines = AgentExit(EXIT_BUSY), ["error: another job holds the lock"]
    with pytest.raises(DeviceBusy, match="another job holds the lock"):
        device.run(SPEC, tmp_path / "out")
    climbing = JobSpec(job_id="j1", kind="generate", model="m")
    climbing.job_id = "../up"  # JobSpec refuses it when built; a transport checks again before it names a folder
    device.calls.clear()
    with pytest.raises(TransportError, match="not a plain name"):
        device.run(climbing, tmp_path / "out")
    assert device.calls == []
