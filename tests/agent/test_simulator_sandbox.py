"""The virtual phone as a sandbox, attacked through adb-shell (the farm's own client) by a
host that is allowed in: code pushed to the phone is never imported by the agent it runs on
the host, every path a `farm-agent` command receives (arguments, the agent's root, paths
inside a job document) stays inside the phone's filesystem or the command is refused, pushed
files lose setuid/setgid/sticky bits, job ids cannot name a path, and the phone asks for
ADB authentication unless told not to. Each escape must fail with a clear error and leave
the host untouched: the marker files below are host paths an escape would create."""

from __future__ import annotations

import io
import json
import stat
import subprocess
import sys

import pytest
from adb_shell import exceptions as adb_exceptions
from adb_shell.auth.keygen import keygen
from adb_shell.auth.sign_pythonrsa import PythonRSASigner
from test_simulator import connect, shell_v2

from agent.simulator import VirtualPhone

TMP = "/data/local/tmp"


@pytest.fixture(scope="module")
def host_key(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "adbkey"
    keygen(str(path))
    return path


@pytest.fixture
def signer(host_key):
    return PythonRSASigner.FromRSAKeyPath(str(host_key))


@pytest.fixture
def phone(tmp_path, host_key, monkeypatch):
    # The agent inherits the phone's environment: a HOME of its own shows whether the agent's
    # default root (~/.local/share/devicefarm-agent) was used on the host.
    monkeypatch.setenv("HOME", str(tmp_path / "host-home"))
    monkeypatch.delenv("FARM_AGENT_ROOT", raising=False)
    with VirtualPhone(serial="sandbox", root=tmp_path / "phone", auth=True, accept_new_keys=True) as p:
        yield p


@pytest.fixture
def device(phone, signer):
    d = connect(phone.port, rsa_keys=[signer])
    yield d
    d.close()


def sh(device, command: str) -> tuple[str, str, int]:
    out, err, code = shell_v2(device, command)
    return out.decode(errors="replace"), err.decode(errors="replace"), code


def push_text(device, path: str, text: str, mode: int = 0o100644) -> None:
    device.push(io.BytesIO(text.encode()), path, st_mode=mode)


def job_doc(**fields) -> str:
    return json.dumps({"job_id": "j1", "kind": "generate", "model": "models/tiny", "steps": 1,
                       "height": 64, "width": 64, "precision": "fp32"} | fields)


# ---- code pushed to the phone never runs on the host -------------------------------------------


def _planted_module(marker) -> str:
    return f"import pathlib\npathlib.Path({str(marker)!r}).write_text('pwned')\n"


@pytest.mark.parametrize("folder", ["/", TMP])
def test_pushed_agent_code_is_not_imported_by_farm_agent(device, phone, tmp_path, folder):
    """`python -m agent.cli` in the phone's current folder would import agent/ and engine/ from
    that folder first."""
    marker = tmp_path / "pwned"
    for module in ("agent/__init__.py", "agent/cli.py", "engine/__init__.py", "engine/errors.py"):
        push_text(device, f"{folder.rstrip('/')}/{module}", _planted_module(marker))
    out, err, code = sh(device, f"cd {folder} && farm-agent info")
    assert not marker.exists(), "a file pushed to the phone ran on the host"
    assert (code == 0 and out) or err.startswith("error:"), (out, err)  # the real agent ran


def test_exported_python_variables_do_not_reach_the_agent(device, phone, tmp_path):
    marker = tmp_path / "pwned"
    push_text(device, f"{TMP}/lib/sitecustomize.py", _planted_module(marker))
    push_text(device, f"{TMP}/lib/agent/__init__.py", _planted_module(marker))
    push_text(device, f"{TMP}/lib/agent/cli.py", _planted_module(marker))
    push_text(device, f"{TMP}/bin/nvidia-smi", f"#!/bin/sh\ntouch {marker}\n", mode=0o100755)
    sh(device, f"export PYTHONPATH={TMP}/lib PATH={TMP}/bin; farm-agent info")
    assert not marker.exists()


def test_an_unsigned_build_planted_in_the_agent_root_runs_no_code(device, phone, tmp_path):
    """A build's own engine and agent are imported by the job's child process on a real
    device; on the virtual phone that child runs on the host, so it never imports them."""
    marker = tmp_path / "pwned"
    build = f"{TMP}/devicefarm/builds/evil"
    manifest = {"build": "evil", "version": "0", "created": 0.0, "files": []}
    push_text(device, f"{build}/manifest.json", json.dumps(manifest))
    push_text(device, f"{TMP}/devicefarm/builds/current", "evil")
    push_text(device, f"{build}/models/tiny/weights", "x")
    for module in ("agent/__init__.py", "agent/jobs.py", "engine/__init__.py"):
        push_text(device, f"{build}/{module}", _planted_module(marker))
    push_text(device, f"{TMP}/job.json", job_doc())
    out, err, code = sh(device, f"farm-agent run {TMP}/job.json --out {TMP}/out --root {TMP}/devicefarm --quiet")
    assert not marker.exists(), "code from the phone's filesystem ran on the host"
    assert code == 1 and "failed: job j1" in out, (out, err)


# ---- paths stay inside the phone ------------------------------------------------------------------


def test_an_absolute_host_path_names_a_file_inside_the_phone(device, phone, tmp_path):
    """`--out /tmp/x` (and a job file of the host's) mean the phone's /tmp/x, never the host's."""
    host_out = tmp_path / "host-out"
    push_text(device, f"{TMP}/job.json", job_doc())
    out, err, code = sh(device, f"farm-agent run {TMP}/job.json --out {host_out} --root {TMP}/devicefarm --quiet")
    assert not host_out.exists(), "the agent wrote on the host"
    assert (phone.root / "fs" / str(host_out).lstrip("/") / "result.json").is_file()
    secret = tmp_path / "secret.json"
    secret.write_text(job_doc(prompt="TOPSECRET"))
    out, err, code = sh(device, f"farm-agent run {secret} --out {TMP}/o2 --root {TMP}/devicefarm")
    assert code == 2 and f"cannot read job file {secret}" in err and "TOPSECRET" not in out + err, (out, err)


def test_a_job_naming_a_host_file_as_its_model_leaks_nothing(device, phone, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"TOPSECRET and more\n")
    leaked_header = str(int.from_bytes(b"TOPSECRE", "little"))  # what a safetensors reader would print
    for field in ({"model": str(secret)}, {"profile": str(secret)}, {"model": f"../../../../../../../..{secret}"}):
        push_text(device, f"{TMP}/job.json", job_doc(**field))
        out, err, code = sh(device, f"farm-agent run {TMP}/job.json --out {TMP}/o --root {TMP}/devicefarm --quiet")
        result = device.shell(f"cat {TMP}/o/result.json {TMP}/o/job.log")
        for text in (out, err, result):
            assert "TOPSECRET" not in text and leaked_header not in text, (field, text)
        assert code in (1, 2) and "error:" in out + err, (field, out, err)


def test_the_agent_root_is_inside_the_phone(device, phone, tmp_path):
    """Without --root the agent would use ~/.local/share/devicefarm-agent of the host."""
    push_text(device, f"{TMP}/job.json", job_doc())
    sh(device, f"farm-agent run {TMP}/job.json --out {TMP}/o --quiet")
    assert not (tmp_path / "host-home").exists(), "the agent used the host's home folder"
    assert (phone.root / "fs" / TMP.lstrip("/") / "devicefarm" / "locks").is_dir()
    out, err, code = sh(device, f"FARM_AGENT_ROOT={tmp_path}/r farm-agent run {TMP}/job.json --out {TMP}/o --quiet")
    assert not (tmp_path / "r").exists()


def test_symlinks_and_dotdot_cannot_lead_the_agent_out(device, phone, tmp_path):
    (phone.root / "fs" / TMP.lstrip("/") / "link").symlink_to(tmp_path)  # planted on the host's side
    push_text(device, f"{TMP}/job.json", job_doc())
    escapes = {
        f"farm-agent run {TMP}/job.json --out {TMP}/link/out1 --root {TMP}/r": tmp_path / "out1",
        f"cd {TMP} && farm-agent run job.json --out link/out2 --root {TMP}/r": tmp_path / "out2",
        f"cd / && farm-agent run {TMP}/job.json --out ../out3 --root {TMP}/r": phone.root / "out3",
        f"farm-agent run {TMP}/job.json --out={TMP}/link/out4 --root {TMP}/r": tmp_path / "out4",
        f"farm-agent run {TMP}/job.json --out {TMP}/o --root {TMP}/link/root5": tmp_path / "root5",
        f"farm-agent install {TMP}/link --root {TMP}/r": None,
    }
    for command, host_path in escapes.items():
        out, err, code = sh(device, command)
        assert code == 2 and "outside the device's filesystem" in err, (command, out, err)
        assert str(phone.root) not in out + err and str(tmp_path) not in out + err, (command, err)
        if host_path is not None:
            assert not host_path.exists(), command


def test_farm_agent_commands_that_open_host_ports_are_refused(device, phone):
    for command in ("farm-agent serve --port 0 --token-file /data/local/tmp/t",
                    "farm-agent simulate --port 0 --serial x"):
        out, err, code = sh(device, command)
        assert code == 2 and "not available on the virtual phone" in err, (command, out, err)


# ---- modes and ids -------------------------------------------------------------------------------


def test_pushed_and_chmodded_files_never_keep_setuid_setgid_or_sticky(device, phone):
    host = phone.root / "fs" / TMP.lstrip("/")
    device.push(io.BytesIO(b"#!/bin/sh\n"), f"{TMP}/suid", st_mode=0o106755)
    assert stat.S_IMODE((host / "suid").stat().st_mode) == 0o755
    device.push(io.BytesIO(b"x"), f"{TMP}/sticky", st_mode=0o101644)
    assert stat.S_IMODE((host / "sticky").stat().st_mode) == 0o644
    out, err, code = sh(device, f"chmod 4755 {TMP}/suid")
    assert code == 1 and "setuid" in err, (out, err)
    assert stat.S_IMODE((host / "suid").stat().st_mode) == 0o755
    assert sh(device, f"chmod 0700 {TMP}/suid")[2] == 0
    assert stat.S_IMODE((host / "suid").stat().st_mode) == 0o700


@pytest.mark.parametrize("job_id", ["../../x", "a/b", ".hidden", "", "x" * 200])
def test_a_job_id_that_is_not_a_plain_name_is_refused(device, phone, job_id):
    push_text(device, f"{TMP}/job.json", job_doc(job_id=job_id))
    out, err, code = sh(device, f"farm-agent run {TMP}/job.json --out {TMP}/o --root {TMP}/devicefarm")
    assert code == 2 and "JobSpec.job_id" in err and "letters, digits" in err, (out, err)
    assert err.count("error:") == 1 and "Traceback" not in err
    assert not (phone.root / "fs" / TMP.lstrip("/") / "o").exists()


# ---- authentication by default -------------------------------------------------------------------


def test_a_phone_asks_for_authentication_by_default(tmp_path, signer, host_key):
    with VirtualPhone(serial="locked", root=tmp_path / "p") as p:
        with pytest.raises(adb_exceptions.DeviceAuthError):
            connect(p.port)  # a host with no key
        with pytest.raises((adb_exceptions.AdbTimeoutError, adb_exceptions.TcpTimeoutException)):
            connect(p.port, rsa_keys=[signer], auth_timeout_s=1.0)  # a key it was never given
        assert not (p.root / "adb_keys").exists()
    keys = tmp_path / "farm-adbkey.pub"
    keys.write_text(host_key.with_suffix(".pub").read_text())
    with VirtualPhone(serial="paired", root=tmp_path / "q", adb_keys=keys) as p:
        d = connect(p.port, rsa_keys=[signer])
        assert d.shell("getprop ro.adb.secure") == "1\n"
        d.close()
    with VirtualPhone(serial="open", root=tmp_path / "r", auth=False) as p:
        d = connect(p.port)
        assert d.shell("getprop ro.adb.secure") == "0\n"
        d.close()


@pytest.mark.parametrize("entry", [["-m", "agent.simulator"], ["-m", "agent.cli", "simulate"]])
def test_the_command_lines_ask_for_authentication_unless_told_not_to(tmp_path, entry, signer, host_key):
    def start(*extra: str) -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen([sys.executable, *entry, "--port", "0", "--serial", "cli", *extra],
                                stdout=subprocess.PIPE, text=True)
        return proc, proc.stdout.readline()

    for extra, keyless_ok in ([(), False], [("--no-auth",), True]):
        proc, line = start("--root", str(tmp_path / f"phone{len(extra)}"), *extra)
        try:
            assert "listening on 127.0.0.1:" in line, line
            assert ("no authentication" in line) == keyless_ok, line
            port = int(line.split("listening on 127.0.0.1:")[1].split()[0])
            if keyless_ok:
                connect(port).close()
            else:
                with pytest.raises(adb_exceptions.DeviceAuthError):
                    connect(port)
        finally:
            proc.terminate()
            assert proc.wait(10) == 0
    proc, line = start("--root", str(tmp_path / "paired"), "--adb-keys", str(host_key.with_suffix(".pub")))
    try:
        port = int(line.split("listening on 127.0.0.1:")[1].split()[0])
        d = connect(port, rsa_keys=[signer])
        assert d.shell("echo in") == "in\n"
        d.close()
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
