"""What every transport does the same way (orchestrator/transports/base.py), on a transport that
reaches nothing: the job time limit, the agent's exit codes, the JobResult checks and the
artifact fetch. The adb, http and local transports' own tests run these through real peers."""

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
    DeviceBusy,
    InfraFailure,
    ProtocolMismatch,
    Transport,
    TransportError,
)


class Nowhere(Transport):
    name = "nowhere"
    job_margin_s = 7.0

    def info(self):
        raise NotImplementedError

    def send_bundle(self, bundle_dir, progress=None):
        raise NotImplementedError

    def run(self, spec, out_dir, progress=None):
        raise NotImplementedError


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
