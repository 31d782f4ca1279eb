"""The virtual phone against real clients: adb-shell (the farm's transport) and Google's adb
host tool, plus its shell, sync, auth, sandbox and thermal model. Device ports come from the
kernel's ephemeral range, never 5555-5585, and Google's adb runs with its own HOME and
server port and is killed at the end."""

from __future__ import annotations

import io
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from adb_shell import exceptions as adb_exceptions
from adb_shell.adb_device import AdbDevice
from adb_shell.auth.keygen import keygen
from adb_shell.auth.sign_pythonrsa import PythonRSASigner
from adb_shell.transport.tcp_transport import TcpTransport
from support import free_port

from agent.simulator import VirtualPhone, run_simulator, wire
from agent.simulator.auth import encode_public_key, parse_public_key
from agent.simulator.shell import AgentSettings
from agent.simulator.thermal import ThermalModel, ThermalSettings

FAST_THERMAL = ThermalSettings(ambient_c=25.0, load_c=75.0, heat_tau_s=0.3, cool_tau_s=0.3)


class NoDelayTcp(TcpTransport):
    """adb-shell writes header and payload separately; without TCP_NODELAY each costs ~40 ms."""

    def connect(self, transport_timeout_s):
        super().connect(transport_timeout_s)
        self._connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def connect(port: int, rsa_keys=None, auth_timeout_s: float = 5.0) -> AdbDevice:
    device = AdbDevice(NoDelayTcp("127.0.0.1", port), default_transport_timeout_s=5.0)
    device.connect(rsa_keys=rsa_keys, auth_timeout_s=auth_timeout_s, read_timeout_s=5.0)
    return device


SHELL_WAIT_S = 120.0  # a command may print nothing for long on a loaded machine (a Python start)


def shell_v2(device: AdbDevice, command: str) -> tuple[bytes, bytes, int]:
    """adb-shell has no shell v2 API; speak it over its stream primitives."""
    info = device._open(b"shell,v2,raw:" + command.encode(), SHELL_WAIT_S, SHELL_WAIT_S, None)
    buf = b"".join(device._read_until_close(info))
    out, err, code = b"", b"", None
    while buf:
        kind, length = struct.unpack_from("<BI", buf)
        data, buf = buf[5:5 + length], buf[5 + length:]
        if kind == 1:
            out += data
        elif kind == 2:
            err += data
        elif kind == 3:
            code = data[0]
    assert code is not None, "no exit packet"
    return out, err, code


@pytest.fixture
def phone(tmp_path):
    p = VirtualPhone(serial="sim-test", root=tmp_path / "phone", thermal=FAST_THERMAL, auth=False)
    p.start()
    yield p
    p.stop()


@pytest.fixture
def device(phone):
    d = connect(phone.port)
    yield d
    d.close()


@pytest.fixture(scope="module")
def host_key(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "adbkey"
    keygen(str(path))
    return path


# ---- wire level ----------------------------------------------------------------------------


def _recv_msg(sock: socket.socket) -> wire.Message:
    header = _recv_exact(sock, 24)
    command, arg0, arg1, length, check = wire.unpack_header(header)
    data = _recv_exact(sock, length)
    assert check == wire.checksum(data), "the device must checksum at version 0x01000000"
    return wire.Message(command, arg0, arg1, data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


def test_handshake_waits_for_host_and_rejects_unknown_service(phone):
    with socket.create_connection(("127.0.0.1", phone.port), timeout=5) as sock:
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # the device speaks only after the host's CNXN
        sock.settimeout(5)
        sock.sendall(wire.pack(wire.Message(wire.CNXN, 0x01000000, 4096, b"host::\0"), 0x01000000))
        cnxn = _recv_msg(sock)
        assert (cnxn.command, cnxn.arg0, cnxn.arg1) == (wire.CNXN, 0x01000000, 4096)
        assert cnxn.data.startswith(b"device::ro.product.name=panther;ro.product.model=Virtual Pixel 7;")
        assert cnxn.data.endswith(b"features=shell_v2,cmd,stat_v2,ls_v2,fixed_push_mkdir")
        sock.sendall(wire.pack(wire.Message(wire.OPEN, 7, 0, b"no-such-service:\0"), 0x01000000))
        clse = _recv_msg(sock)
        assert (clse.command, clse.arg0, clse.arg1) == (wire.CLSE, 0, 7)


def test_one_write_in_flight_per_stream_when_the_host_acknowledges_late(tmp_path):
    """A host that acknowledges late (its worker blocked, its store out of reach) has both of a
    shell v2 stream's pumps, stdout and stderr, waiting for its OKAY. When it comes, one WRTE
    follows, not one per pump: two in flight break ADB's flow control, and the farm's adb
    transport closes the connection (it once failed a job so, after a partition)."""
    code = ("import sys, time\n"
            "for i in range(50):\n"
            "    print('o' * 64, flush=True); print('e' * 64, file=sys.stderr, flush=True); time.sleep(0.01)")
    agent = AgentSettings(command=(sys.executable, "-c", code))
    with VirtualPhone(serial="flow", root=tmp_path / "p", agent=agent, auth=False) as p, \
            socket.create_connection(("127.0.0.1", p.port), timeout=10) as sock:
        sock.sendall(wire.pack(wire.Message(wire.CNXN, 0x01000000, 4096, b"host::\0"), 0x01000000))
        assert _recv_msg(sock).command == wire.CNXN
        sock.sendall(wire.pack(wire.Message(wire.OPEN, 7, 0, b"shell,v2,raw:farm-agent\0"), 0x01000000))
        opened = _recv_msg(sock)
        assert opened.command == wire.OKAY
        ack = wire.pack(wire.Message(wire.OKAY, 7, opened.arg0), 0x01000000)
        assert _recv_msg(sock).command == wire.WRTE
        in_flight = []
        for _ in range(4):
            time.sleep(0.3)  # the agent has written to both pipes since: both pumps wait for the OKAY
            sock.sendall(ack)
            sock.settimeout(0.3)
            writes = 0
            try:
                while True:
                    writes += _recv_msg(sock).command == wire.WRTE
            except TimeoutError:
                pass
            sock.settimeout(10)
            in_flight.append(writes)
        assert in_flight == [1, 1, 1, 1]


# ---- adb-shell -----------------------------------------------------------------------------


def test_adb_shell_shell_v1_and_v2_exit_codes(device):
    assert device.shell("echo hi") == "hi\n"
    out, err, code = shell_v2(device, "echo out; ls /nope; test -d /data/local/tmp && exit 7")
    assert out == b"out\n"
    assert err == b"ls: /nope: No such file or directory\n"
    assert code == 7
    out, err, code = shell_v2(device, "frobnicate --now")
    assert (out, err, code) == (b"", b"sh: frobnicate: not found\n", 127)
    assert shell_v2(device, "false || echo fallback; true && echo yes")[::2] == (b"fallback\nyes\n", 0)
    assert shell_v2(device, "test -f /data/local/tmp")[2] == 1
    assert shell_v2(device, "test -e /data/local/tmp/missing")[2] == 1
    assert device.shell("echo 'a  b' \"c;d\"; echo $?") == "a  b c;d\n0\n"


def test_adb_shell_push_pull_list_stat(device, phone):
    big = os.urandom(3 * 1024 * 1024 + 17)
    device.push(io.BytesIO(big), "/data/local/tmp/deep/dir/big.bin", st_mode=0o100644, mtime=1_700_000_000)
    back = io.BytesIO()
    device.pull("/data/local/tmp/deep/dir/big.bin", back)
    assert back.getvalue() == big
    assert (phone.root / "fs/data/local/tmp/deep/dir/big.bin").read_bytes() == big
    mode, size, mtime = device.stat("/data/local/tmp/deep/dir/big.bin")
    assert (mode, size, mtime) == (0o100644, len(big), 1_700_000_000)
    assert device.stat("/data/local/tmp/absent") == (0, 0, 0)
    names = {f.filename.decode(): f for f in device.list("/data/local/tmp/deep/dir")}
    assert set(names) == {".", "..", "big.bin"} and names["big.bin"].size == len(big)
    # shell and sync see the same file
    assert device.shell("stat -c %s /data/local/tmp/deep/dir/big.bin") == f"{len(big)}\n"
    import hashlib

    assert device.shell("sha256sum /data/local/tmp/deep/dir/big.bin").split()[0] == hashlib.sha256(big).hexdigest()
    with pytest.raises(adb_exceptions.AdbCommandFailureException):
        device.pull("/data/local/tmp/absent", io.BytesIO())


def test_file_commands(device):
    script = ("mkdir -p /sdcard/a/b && echo one > /sdcard/a/b/f.txt && echo two >> /sdcard/a/b/f.txt"
              " && mv /sdcard/a/b/f.txt /sdcard/a/g.txt && cat /sdcard/a/g.txt && ls /sdcard/a"
              " && rm -rf /sdcard/a && ls /sdcard/a; echo $?")
    assert device.shell(script) == ("one\ntwo\nb\ng.txt\nls: /sdcard/a: No such file or directory\n1\n")
    assert device.shell("cd /data/local/tmp && touch x && ls -l x").startswith("-rw")
    assert device.shell("echo dumb > /sys/class/thermal/thermal_zone0/temp; echo $?").endswith("1\n")
    assert device.shell("getprop | grep devicefarm.virtual | wc -l") == "1\n"


def test_concurrent_connections_and_streams(phone):
    results, errors = [], []

    def worker(i: int) -> None:
        try:
            d = connect(phone.port)
            for j in range(5):
                results.append(d.shell(f"echo {i}-{j}") == f"{i}-{j}\n")
            d.close()
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(results) == 30 and all(results)


# ---- authentication --------------------------------------------------------------------------


def test_auth_accepts_new_key_persists_and_reuses_it(tmp_path, host_key):
    signer = PythonRSASigner.FromRSAKeyPath(str(host_key))
    root = tmp_path / "phone"
    with VirtualPhone(serial="auth-1", root=root, auth=True, accept_new_keys=True) as p:
        d = connect(p.port, rsa_keys=[signer])
        assert d.shell("echo ok") == "ok\n"
        d.close()
    stored = (root / "adb_keys").read_text().split()
    assert stored[0] == host_key.with_suffix(".pub").read_text().split()[0]
    # a phone that accepts nothing new still knows this host: the signature is enough
    with VirtualPhone(serial="auth-1", root=root, auth=True, accept_new_keys=False) as p:
        d = connect(p.port, rsa_keys=[signer], auth_timeout_s=2.0)
        assert d.shell("getprop ro.adb.secure") == "1\n"
        d.close()
    assert len((root / "adb_keys").read_text().splitlines()) == 1


def test_auth_refuses_unknown_key_with_silence(tmp_path, host_key):
    signer = PythonRSASigner.FromRSAKeyPath(str(host_key))
    with VirtualPhone(serial="auth-2", root=tmp_path / "phone", auth=True, accept_new_keys=False) as p:
        with pytest.raises((adb_exceptions.AdbTimeoutError, adb_exceptions.TcpTimeoutException)):
            connect(p.port, rsa_keys=[signer], auth_timeout_s=1.0)
        with pytest.raises(adb_exceptions.DeviceAuthError):
            connect(p.port, rsa_keys=None)
        assert not (p.root / "adb_keys").exists()


def test_public_key_format_round_trip(host_key):
    text = host_key.with_suffix(".pub").read_text()
    key, comment = parse_public_key(text + "\0")
    assert encode_public_key(key, comment).split()[0] == text.split()[0]


# ---- sandbox -----------------------------------------------------------------------------------


def test_path_traversal_is_blocked(device, phone, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    rel = os.path.relpath(outside, phone.root / "fs")
    assert "secret" not in device.shell(f"cat /{rel}; cat ../../../../{rel}")
    with pytest.raises(adb_exceptions.AdbCommandFailureException):
        device.pull(f"/../../../../{rel}", io.BytesIO())
    device.push(io.BytesIO(b"x"), "/../../../../escape.txt")
    assert (phone.root / "fs/escape.txt").read_bytes() == b"x"
    assert not (phone.root.parent / "escape.txt").exists()
    # a symlink planted in the sandbox cannot lead out of it
    (phone.root / "fs/data/local/tmp/link").symlink_to(tmp_path)
    assert "secret" not in device.shell("cat /data/local/tmp/link/outside.txt")
    assert device.shell("echo hack > /data/local/tmp/link/new.txt; echo $?") .endswith("1\n")
    assert not (tmp_path / "new.txt").exists()
    with pytest.raises(adb_exceptions.AdbCommandFailureException):
        device.pull("/data/local/tmp/link/outside.txt", io.BytesIO())


# ---- Android formats -----------------------------------------------------------------------------


def test_getprop_formats(device):
    props = device.shell("getprop")
    lines = props.splitlines()
    keys = [re.fullmatch(r"\[([\w.]+)\]: \[.*\]", line).group(1) for line in lines]
    assert keys == sorted(keys)
    assert "[ro.product.manufacturer]: [devicefarm]" in lines
    assert "[ro.product.model]: [Virtual Pixel 7]" in lines
    assert "[ro.devicefarm.virtual]: [1]" in lines
    assert "ro.kernel.qemu" not in props
    assert device.shell("getprop ro.product.model") == "Virtual Pixel 7\n"
    assert device.shell("getprop ro.kernel.qemu") == "\n"
    assert device.shell("uname -a").startswith("Linux localhost ")


def test_dumpsys_formats(device):
    battery = device.shell("dumpsys battery")
    assert battery.startswith("Current Battery Service state:\n  AC powered: false\n")
    assert re.search(r"^  temperature: \d+$", battery, re.M)
    assert re.search(r"^  level: \d+$", battery, re.M)
    thermal = device.shell("dumpsys thermalservice")
    assert re.search(r"^Thermal Status: [0-6]$", thermal, re.M)
    temps = re.findall(r"^\tTemperature\{mValue=([\d.]+), mType=(\d), mName=([\w-]+), mStatus=\d\}$", thermal, re.M)
    assert {name for _, _, name in temps} >= {"BIG", "G3D", "battery", "VIRTUAL-SKIN"}
    assert device.shell("dumpsys nosuch") == "Can't find service: nosuch\n"


def test_adreno_model_has_kgsl(tmp_path):
    with VirtualPhone(serial="s23", model="Galaxy S23 Ultra", root=tmp_path / "p", auth=False) as p:
        d = connect(p.port)
        assert d.shell("cat /sys/class/kgsl/kgsl-3d0/gpu_model") == "Adreno740v2\n"
        assert int(d.shell("cat /sys/class/kgsl/kgsl-3d0/temp")) == pytest.approx(28000, abs=500)
        assert d.shell("getprop ro.hardware.vulkan") == "adreno\n"
        d.close()
    with pytest.raises(ValueError, match="known models"):
        VirtualPhone(model="Nokia 3310")


# ---- thermal model and the agent ---------------------------------------------------------------


def test_thermal_model_rises_under_load_and_decays():
    now = [0.0]
    model = ThermalModel(ThermalSettings(ambient_c=25, load_c=75, heat_tau_s=10, cool_tau_s=20), clock=lambda: now[0])
    model.job_started()
    now[0] = 10.0
    assert model.soc_celsius() == pytest.approx(75 - 50 / 2.718281828, rel=1e-6)
    model.job_finished()
    hot = model.soc_celsius()
    now[0] = 30.0
    assert model.soc_celsius() == pytest.approx(25 + (hot - 25) / 2.718281828, rel=1e-6)


def _zone0(device) -> float:
    return int(device.shell("cat /sys/class/thermal/thermal_zone0/temp")) / 1000


def test_thermal_rises_while_agent_runs_and_falls_after(tmp_path):
    agent = AgentSettings(command=(sys.executable, "-c", "import time; time.sleep(1.0)"))
    with VirtualPhone(serial="hot", root=tmp_path / "p", thermal=FAST_THERMAL, agent=agent, auth=False) as p:
        d, watcher = connect(p.port), connect(p.port)
        cold = _zone0(watcher)
        job = threading.Thread(target=d.shell, args=("farm-agent run",))
        job.start()
        time.sleep(0.7)
        hot = _zone0(watcher)
        hot_battery = int(re.search(r"temperature: (\d+)", watcher.shell("dumpsys battery")).group(1))
        job.join(10)
        time.sleep(1.2)
        cooled = _zone0(watcher)
        assert hot > cold + 20 and cooled < hot - 20, (cold, hot, cooled)
        assert hot_battery > 260
        d.close()
        watcher.close()


def test_agent_on_the_phone_reads_the_phones_thermal_zones(tmp_path):
    """The agent's cool-down reads the phone's simulated zones (mirrored for it while it runs),
    not the host's: its readings lie in the phone's range, start no colder than the idle phone
    and rise with the phone's load.

    The phone lives in a freezer (-38 C idle, -8 C under load) so that no host zone can pass for
    it, and heats with a 5 s time constant so that its rise is still visible after a slow start
    of the agent's Python on a loaded machine."""
    code = ("import time; from agent.deviceinfo import read_thermal_local, hottest_celsius\n"
            "for _ in range(3):\n    print(hottest_celsius(read_thermal_local()), flush=True); time.sleep(0.6)")
    agent = AgentSettings(command=(sys.executable, "-c", code))
    freezer = ThermalSettings(ambient_c=-38.0, load_c=-8.0, heat_tau_s=5.0, cool_tau_s=5.0)
    with VirtualPhone(serial="thermo", root=tmp_path / "p", thermal=freezer, agent=agent, auth=False) as p:
        d = connect(p.port)
        zones = d.shell("cat /sys/class/thermal/thermal_zone*/temp").split()
        idle_hottest = max(int(z) for z in zones) / 1000
        hottest_possible = freezer.load_c + max(zone.offset_c for zone in p.model.zones)
        out, err, status = shell_v2(d, "farm-agent")
        assert status == 0, err
        readings = [float(v) for v in out.decode().split()]
        assert len(readings) == 3
        assert all(idle_hottest - 0.01 <= r <= hottest_possible + 0.01 for r in readings), (readings, idle_hottest)
        assert readings[-1] > readings[0] + 0.3, readings
        d.close()


def test_farm_agent_paths_translate_both_ways(tmp_path):
    code = "import os, sys; print(os.getcwd()); print(sys.argv[1]); print(open(sys.argv[2]).read()); sys.exit(4)"
    agent = AgentSettings(command=(sys.executable, "-c", code))
    with VirtualPhone(serial="paths", root=tmp_path / "p", agent=agent, auth=False) as p:
        d = connect(p.port)
        d.push(io.BytesIO(b"spec"), "/data/local/tmp/job/spec.json")
        out, err, status = shell_v2(d, "cd /data/local/tmp/job && farm-agent --out=/data/local/tmp/job/o spec.json")
        assert out.decode().splitlines() == ["/data/local/tmp/job", "--out=/data/local/tmp/job/o", "spec"]
        assert str(p.root).encode() not in out and status == 4
        d.close()


def test_real_farm_agent_runs_and_closing_the_stream_kills_the_agent(tmp_path):
    with VirtualPhone(serial="agent", root=tmp_path / "p", auth=False) as p:
        d = connect(p.port)
        out, err, status = shell_v2(d, "farm-agent --help")
        assert status == 0 and b"Usage:" in out and b"info" in out, err
        d.close()
    pid_file = tmp_path / "q/fs/pid"
    code = "import os, time; open('pid', 'w').write(str(os.getpid())); time.sleep(30)"
    with VirtualPhone(serial="kill", root=tmp_path / "q", auth=False,
                      agent=AgentSettings(command=(sys.executable, "-c", code))) as p:
        d = connect(p.port)
        info = d._open(b"shell,v2,raw:farm-agent", None, 10.0, None)
        deadline = time.time() + 10
        while not (pid_file.is_file() and pid_file.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        d._clse(info)  # CLSE, then the device's echo
        deadline = time.time() + 5
        while _alive(pid) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)
        # the phone counts the job as ended once it has reaped the agent, a moment after the kill
        while p.thermal.running_jobs and time.time() < deadline + 5:
            time.sleep(0.05)
        assert p.thermal.running_jobs == 0
        d.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_run_simulator_serves_until_stopped(tmp_path):
    ports = []
    ready = threading.Event()

    def on_ready(port: int) -> None:
        ports.append(port)
        ready.set()

    stop = threading.Event()
    t = threading.Thread(target=run_simulator, args=(0, "entry"), daemon=True,
                         kwargs={"root": tmp_path / "r", "ready": on_ready, "stop_event": stop, "auth": False})
    t.start()
    assert ready.wait(10)
    d = connect(ports[0])
    assert d.shell("getprop ro.serialno") == "entry\n"
    d.close()
    stop.set()
    t.join(5)
    assert not t.is_alive()
    # the command-line entry point stops on SIGTERM
    proc = subprocess.Popen([sys.executable, "-m", "agent.simulator", "--port", "0", "--serial", "cli",
                             "--root", str(tmp_path / "cli"), "--no-auth"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "listening on 127.0.0.1:" in line
    d = connect(int(line.rsplit(":", 1)[1].split()[0]))
    assert d.shell("getprop ro.serialno") == "cli\n"
    d.close()
    proc.terminate()
    assert proc.wait(10) == 0


# ---- Google's adb ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def google_adb(tmp_path_factory):
    exe = shutil.which("adb")
    if exe is None:
        pytest.fail("Google's adb is not installed (Debian/Ubuntu: apt-get install adb)")
    home = tmp_path_factory.mktemp("adb-home")
    env = {**os.environ, "HOME": str(home), "ANDROID_ADB_SERVER_PORT": str(free_port())}
    env.pop("ADB_VENDOR_KEYS", None)

    def adb(*args: str, timeout: float = 20, check: bool = True, input: str | None = None):
        done = subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=timeout,
                              **({"input": input} if input is not None else {"stdin": subprocess.DEVNULL}))
        if check and done.returncode != 0:
            raise AssertionError(f"adb {' '.join(args)} -> {done.returncode}: {done.stdout}{done.stderr}")
        return done

    adb("start-server")
    adb.home = home
    try:
        yield adb
    finally:
        adb("kill-server", check=False)


def _wait_state(adb, serial: str, state: str, timeout: float = 10) -> str:
    deadline = time.time() + timeout
    line = ""
    while time.time() < deadline:
        line = next((x for x in adb("devices").stdout.splitlines() if x.startswith(serial)), "")
        if line.split("\t")[-1:] == [state]:
            return line
        time.sleep(0.1)
    raise AssertionError(f"{serial} never reached {state!r}: {line!r}")


def test_google_adb_shell_push_pull_ls(google_adb, phone, tmp_path):
    serial = f"127.0.0.1:{phone.port}"
    assert "connected" in google_adb("connect", serial).stdout
    _wait_state(google_adb, serial, "device")
    assert google_adb("-s", serial, "shell", "echo", "hi").stdout == "hi\n"
    assert google_adb("-s", serial, "shell", "exit 5", check=False).returncode == 5
    data = os.urandom(2 * 1024 * 1024 + 3)
    (tmp_path / "up.bin").write_bytes(data)
    google_adb("-s", serial, "push", str(tmp_path / "up.bin"), "/data/local/tmp/g/up.bin")
    google_adb("-s", serial, "pull", "/data/local/tmp/g/up.bin", str(tmp_path / "down.bin"))
    assert (tmp_path / "down.bin").read_bytes() == data
    assert google_adb("-s", serial, "shell", "ls", "/data/local/tmp/g").stdout == "up.bin\n"
    assert "up.bin" in google_adb("-s", serial, "ls", "/data/local/tmp/g").stdout
    # shell v2 stdin: adb forwards its stdin, then a close-stdin packet
    assert google_adb("-s", serial, "shell", "cat", input="piped\n").stdout == "piped\n"
    google_adb("disconnect", serial)


def test_google_adb_auth_accepts_its_own_key(google_adb, tmp_path):
    with VirtualPhone(serial="gauth", root=tmp_path / "p", auth=True, accept_new_keys=True) as p:
        serial = f"127.0.0.1:{p.port}"
        google_adb("connect", serial)
        _wait_state(google_adb, serial, "device")
        assert google_adb("-s", serial, "shell", "getprop", "ro.adb.secure").stdout == "1\n"
        adb_pub = (google_adb.home / ".android/adbkey.pub").read_text().split()[0]
        assert (p.root / "adb_keys").read_text().split()[0] == adb_pub
        google_adb("disconnect", serial)


def test_google_adb_auth_refused_stays_unauthorized(google_adb, tmp_path):
    with VirtualPhone(serial="gdeny", root=tmp_path / "p", auth=True, accept_new_keys=False) as p:
        serial = f"127.0.0.1:{p.port}"
        google_adb("connect", serial, check=False)
        _wait_state(google_adb, serial, "unauthorized")
        done = google_adb("-s", serial, "shell", "echo", "hi", check=False)
        assert done.returncode != 0 and "hi" not in done.stdout
        assert not (p.root / "adb_keys").exists()
        google_adb("disconnect", serial, check=False)


def test_trusted_key_is_provisioned_when_it_appears(tmp_path):
    from agent.bundle import generate_keypair

    trust = tmp_path / "config" / "farm.pub"
    ready, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=run_simulator, args=(0, "trusting"), daemon=True,
                         kwargs={"root": tmp_path / "r", "ready": lambda port: ready.set(), "stop_event": stop,
                                 "trust": trust})
    t.start()
    try:
        assert ready.wait(10)  # serving before the farm has a key
        provisioned = tmp_path / "r" / "fs" / "data/local/tmp/devicefarm/farm.pub"
        assert not provisioned.exists()
        generate_keypair(tmp_path / "config" / "farm.key", trust)
        deadline = time.monotonic() + 10
        while not provisioned.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert provisioned.read_bytes() == trust.read_bytes()
    finally:
        stop.set()
        t.join(5)
