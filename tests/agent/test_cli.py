"""`farm-agent` through Typer's CliRunner: exit codes (0 succeeded, 1 failed, 2 bad input, 75
busy), one-line errors without tracebacks, install with the farm's key, resume's chunks,
simulate's wiring."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent import jobs
from agent.cli import app
from agent.protocol import DeviceInfo, JobResult, from_json

runner = CliRunner()


def job_file(tmp_path: Path, **fields) -> Path:
    doc = {"job_id": "c1", "kind": "generate", "model": "models/tiny", "steps": 1, "precision": "fp32"} | fields
    path = tmp_path / "job.json"
    path.write_text(json.dumps(doc))
    return path


def agent(*args, **kw):
    return runner.invoke(app, [str(a) for a in args], **kw)


def signed_bundle(tmp_path: Path, build_id: str = "b1") -> tuple[Path, Path]:
    """(bundle folder, farm public key file) of a small signed build."""
    from agent.bundle import generate_keypair
    from agent.packing import build_bundle

    key = generate_keypair(tmp_path / "keys" / "farm.key", tmp_path / "keys" / "farm.pub")
    src = tmp_path / "src"
    (src / "models" / "m").mkdir(parents=True)
    (src / "models" / "m" / "weights.bin").write_bytes(os.urandom(1000))
    build_bundle({"models": src / "models"}, tmp_path / f"bundle-{build_id}", build_id, "0.1", key)
    return tmp_path / f"bundle-{build_id}", tmp_path / "keys" / "farm.pub"


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "JobSpec: not valid JSON"),
    (json.dumps({"job_id": "c1", "kind": "train", "model": "m"}), "JobSpec.kind: 'train' is not one of"),
    (json.dumps({"job_id": "c1", "kind": "generate", "model": "m", "colour": 1}), "unknown field(s) colour"),
    (json.dumps({"job_id": "c1", "kind": "generate", "model": "m", "protocol": 9}), "speaks protocol 9"),
    (json.dumps({"job_id": "c1", "kind": "generate", "model": "m", "steps": 0}), "steps must be at least 1"),
    (json.dumps({"job_id": "../../x", "kind": "generate", "model": "m"}), "JobSpec.job_id '../../x': use letters"),
])
def test_bad_job_document_exits_2_with_the_message(tmp_path, text, message):
    (tmp_path / "job.json").write_text(text)
    r = agent("run", tmp_path / "job.json", "--out", tmp_path / "out", "--root", tmp_path / "root")
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_missing_job_file_exits_2(tmp_path):
    r = agent("run", tmp_path / "nope.json", "--out", tmp_path / "out", "--root", tmp_path / "root")
    assert r.exit_code == 2 and "cannot read job file" in r.output


def test_job_from_stdin(tmp_path):
    r = agent("run", "-", "--out", tmp_path / "out", "--root", tmp_path / "root", "--quiet",
              input=json.dumps({"job_id": "s1", "kind": "generate", "model": "models/x"}))
    assert r.exit_code == 1 and "failed: job s1 (generate)" in r.output


def test_failed_job_exits_1_and_streams_progress(tmp_path):
    r = agent("run", job_file(tmp_path), "--out", tmp_path / "out", "--root", tmp_path / "root")
    assert r.exit_code == 1, r.output
    assert "failed: job c1 (generate)" in r.output and "no build is installed" in r.output
    events = [json.loads(line) for line in r.output.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events] == ["started", "finished"]
    assert from_json(JobResult, (tmp_path / "out" / "result.json").read_text()).status == "failed"


def test_busy_device_exits_75(tmp_path):
    root = tmp_path / "root"
    (root / "locks").mkdir(parents=True)
    (root / "locks" / jobs.LOCK_NAME).write_text(json.dumps(
        {"job_id": "other", "pid": os.getpid(), "started_at": time.time(), "time_limit_s": 60}))
    r = agent("run", job_file(tmp_path), "--out", tmp_path / "out", "--root", root)
    assert r.exit_code == 75, r.output
    assert "error: device busy with job 'other' since" in r.output


def test_root_defaults_to_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FARM_AGENT_ROOT", str(tmp_path / "envroot"))
    r = agent("run", job_file(tmp_path), "--out", tmp_path / "out", "--quiet")
    assert r.exit_code == 1
    assert str(tmp_path / "envroot" / "builds") in r.output  # "no build is installed under <root>/builds"


@pytest.mark.gpu
def test_generate_job_succeeds_exit_0_with_json(tiny_model_dir, tmp_path):
    r = agent("run", job_file(tmp_path, model=str(tiny_model_dir), scheduler="euler"), "--out", tmp_path / "out",
              "--root", tmp_path / "root", "--quiet", "--json")
    assert r.exit_code == 0, r.output
    result = from_json(JobResult, r.stdout)
    assert result.status == "succeeded" and any(a.path == "image.png" for a in result.artifacts)


def test_install_with_key_then_run_against_the_build(tmp_path):
    bundle, pub = signed_bundle(tmp_path)
    root = tmp_path / "root"
    r = agent("install", bundle, "--root", root, "--public-key", pub)
    assert r.exit_code == 0, r.output
    assert "installed build b1 (1 files)" in r.output
    from agent.bundle import current_build

    assert current_build(root).build_id == "b1"
    # the job's relative model now resolves inside the build (and fails later, in the engine)
    task = jobs.make_task(from_json(jobs.JobSpec, job_file(tmp_path, model="models/m").read_text()), root, tmp_path)
    assert task.model == str(root / "builds" / "b1" / "models" / "m") and task.build == "b1"


def test_install_uses_farm_pub_in_the_root_and_refuses_tampering(tmp_path):
    bundle, pub = signed_bundle(tmp_path)
    root = tmp_path / "root"
    r = agent("install", bundle, "--root", root)
    assert r.exit_code == 1 and "farm.pub" in r.output and "Traceback" not in r.output
    root.mkdir(exist_ok=True)
    (root / "farm.pub").write_bytes(pub.read_bytes())
    (bundle / "files" / "models" / "m" / "weights.bin").write_bytes(b"evil")
    r = agent("install", bundle, "--root", root)
    assert r.exit_code == 1 and "install refused" in r.output and "size mismatch" in r.output
    r = agent("install", tmp_path / "nope", "--root", root)
    assert r.exit_code == 2 and "does not exist" in r.output


def test_resume_appends_the_pushed_chunks_and_prints_what_it_holds(tmp_path):
    from agent.bundle import RESUME, generate_keypair, provision_public_key
    from agent.packing import build_bundle

    key = generate_keypair(tmp_path / "farm.key", tmp_path / "farm.pub")
    (tmp_path / "src").mkdir()
    data = os.urandom(150_000)  # 3 chunks of 64 KiB
    (tmp_path / "src/w.bin").write_bytes(data)
    manifest = build_bundle({"m": tmp_path / "src"}, tmp_path / "bundle", "b1", "0.1", key, chunk_size=64 << 10)
    root, staging = tmp_path / "root", tmp_path / "root/incoming/b1"
    provision_public_key(root, tmp_path / "farm.pub")
    staging.mkdir(parents=True)
    for name in ("manifest.json", "manifest.sig"):
        (staging / name).write_bytes((tmp_path / "bundle" / name).read_bytes())
    sha, folder = manifest.files[0].sha256, root / RESUME
    folder.mkdir(parents=True)
    (folder / f"{sha}.0").write_bytes(data[:1 << 16])
    (folder / f"{sha}.1").write_bytes(data[1 << 16:(1 << 16) + 10])  # cut mid-push
    r = agent("resume", staging, "--root", root, "--check")
    assert r.exit_code == 0 and json.loads(r.output) == {"held": {sha: 1 << 16}}, r.output
    for k in (1, 2):
        (folder / f"{sha}.{k}").write_bytes(data[k << 16:(k + 1) << 16])
    r = agent("resume", staging, "--root", root)
    assert json.loads(r.output) == {"held": {sha: len(data)}} and (staging / "files/m/w.bin").read_bytes() == data
    (staging / "manifest.sig").write_bytes(b"\0" * 64)
    r = agent("resume", staging, "--root", root)
    assert r.exit_code == 1 and "resume refused: manifest.json: manifest signature does not verify" in r.output


def test_simulate_calls_run_simulator(monkeypatch, tmp_path):
    calls = []

    def run_simulator(*a, ready=None, **kw):
        calls.append((a, kw))
        ready(5555)

    monkeypatch.setattr("agent.simulator.run_simulator", run_simulator)
    r = agent("simulate", "--port", 5555, "--serial", "emu-1", "--model", "Galaxy S23", "--root", tmp_path, "--auth")
    assert r.exit_code == 0, r.output
    assert calls == [((5555, "emu-1"), {"model": "Galaxy S23", "root": tmp_path, "auth": True, "host": "127.0.0.1",
                      "trust": None, "adb_keys": None, "accept_new_keys": False})]
    assert "virtual phone emu-1 (Galaxy S23) listening on 127.0.0.1:5555" in r.output
    calls.clear()
    r = agent("simulate", "--port", 5555, "--serial", "emu-2", "--adb-keys", tmp_path / "adbkey.pub")
    assert r.exit_code == 0 and calls[0][1]["auth"] and calls[0][1]["adb_keys"] == tmp_path / "adbkey.pub", r.output
    assert "adbkey.pub does not exist yet" in r.output
    calls.clear()
    r = agent("simulate", "--port", 5555, "--serial", "emu-3", "--no-auth")
    assert r.exit_code == 0 and not calls[0][1]["auth"] and "(no authentication)" in r.output, r.output


def test_serve_refuses_without_a_token(tmp_path):
    r = agent("serve", "--port", 0, "--token-file", tmp_path / "missing", "--root", tmp_path / "root")
    assert r.exit_code == 1 and "cannot read the token file" in r.output
    (tmp_path / "empty").write_text("  \n")
    (tmp_path / "empty").chmod(0o600)
    r = agent("serve", "--port", 0, "--token-file", tmp_path / "empty", "--root", tmp_path / "root")
    assert r.exit_code == 1 and "is empty" in r.output


@pytest.mark.gpu
def test_info_json_is_a_device_info():
    r = agent("info", "--json")
    assert r.exit_code == 0, r.output
    info = from_json(DeviceInfo, r.stdout)
    assert info.adapter["device"] and info.os
    r = agent("info")
    assert r.exit_code == 0 and info.adapter["device"] in r.output


@pytest.mark.gpu
def test_sigterm_kills_the_job_writes_the_result_and_frees_the_lock(tiny_model_dir, tmp_path):
    """What the virtual phone (and adb) do to stop an agent: SIGTERM to `python -m agent.cli`."""
    import signal
    import subprocess

    job = job_file(tmp_path, kind="latency", model=str(tiny_model_dir), unet_repetitions=100000, height=32,
                   width=32)
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "run", str(job), "--out", str(tmp_path / "out"),
                             "--root", str(tmp_path / "root")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    for line in proc.stderr:  # wait until the child is in the middle of the GPU work
        if '"phase": "unet_step"' in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, out
    result = from_json(JobResult, (tmp_path / "out" / "result.json").read_text())
    assert result.status == "failed" and result.error.startswith("job interrupted")
    pid = int(result.log_tail.split("job process ")[-1].split()[0]) if "job process " in result.log_tail else None
    assert not (tmp_path / "root" / "locks" / jobs.LOCK_NAME).exists()
    if pid is not None:
        assert not jobs.pid_alive(pid)
