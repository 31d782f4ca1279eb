"""The ADB connection against a hostile phone (issue 27, item 4): a peer speaking ADB over TCP
that announces 4 GiB messages and sends a 400 MB one (the host buffered it: RSS 48 -> 449
MiB), floods WRTEs without waiting for OKAY (the reverse tunnel's queue grew to 646 MiB in
3.5 s) and sends 1500 OPENs (1761 threads, 1139 fds). The host keeps to the 1 MiB it
announced, keeps ADB's one-WRTE-in-flight rule, caps the phone's streams, sends refusals from
one thread, and closes a misbehaving connection with a logged reason."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable

import pytest
from adb_shell import constants
from adb_shell.adb_message import checksum
from adb_shell.transport.tcp_transport import TcpTransport

from orchestrator.transports.adb_shared import (
    DEVICE_STREAM_IDS,
    HOST_MAX_DATA,
    MAX_PHONE_STREAMS,
    SharedAdbDevice,
    SharedIO,
)

CNXN, OPEN, OKAY, WRTE, CLSE = (constants.CNXN, constants.OPEN, constants.OKAY, constants.WRTE, constants.CLSE)


def _message(command: bytes, arg0: int, arg1: int, data: bytes = b"", length: int | None = None) -> bytes:
    wire = constants.ID_TO_WIRE[command]
    return struct.pack("<6I", wire, arg0, arg1, len(data) if length is None else length, checksum(data),
                       wire ^ 0xFFFFFFFF) + data


def _read_message(sock: socket.socket) -> tuple[bytes, int, int, bytes]:
    header = _exact(sock, 24)
    wire, arg0, arg1, length, _, _ = struct.unpack("<6I", header)
    return constants.WIRE_TO_ID[wire], arg0, arg1, _exact(sock, length) if length else b""


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


class HostilePhone:
    """An ADB peer on 127.0.0.1: answers the host's CNXN with its own (announcing `maxdata`),
    then runs `script(sock)` on the connection."""

    def __init__(self, maxdata: int, script: Callable[[socket.socket], None]):
        self.listening = threading.Event()  # the host takes the phone's OPENs of tcp:9999
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.maxdata, self.script, self.error = maxdata, script, None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            try:
                command, *_ = _read_message(conn)
                assert command == CNXN
                conn.sendall(_message(CNXN, constants.VERSION, self.maxdata, b"device::ro.product.name=hostile;\0"))
                self.script(conn)
            except (OSError, ConnectionError) as exc:
                self.error = exc

    def close(self) -> None:
        self.server.close()


def _connect(port: int) -> SharedAdbDevice:
    device = SharedAdbDevice(TcpTransport("127.0.0.1", port), default_transport_timeout_s=5.0)
    device.connect(rsa_keys=None, auth_timeout_s=5.0)
    return device


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_4_gib_maximum_and_a_400_mb_message_are_refused_not_buffered():
    def script(sock):
        sock.sendall(_message(WRTE, 1, DEVICE_STREAM_IDS, length=400 * 2**20))  # the header alone...
        for _ in range(200):  # ...then its body, 1 MiB at a time, for as long as the host reads
            sock.sendall(b"\x00" * 2**20)

    phone = HostilePhone(0xFFFFFFFF, script)
    rss = _rss_mib()
    try:
        device = _connect(phone.port)
        assert device.io.maxdata == HOST_MAX_DATA  # the phone's 4 GiB is not what the host keeps to
        assert _until(lambda: not device.alive), "the connection stayed open"
        assert "more than the 1048576 the host announced" in str(device.io.error)
        assert _rss_mib() - rss < 64, f"the host grew {_rss_mib() - rss:.0f} MiB"
    finally:
        phone.close()


class _Taker:
    """A listener for tcp:9999 that accepts every OPEN and acknowledges nothing it is sent."""

    def __init__(self):
        self.opened, self.writes, self.lost = 0, 0, None

    def on_open(self, io: SharedIO, remote_id: int, destination: str) -> None:
        def accept():
            local_id = io.new_stream(self)
            self.opened += 1
            io.post(OKAY, local_id, remote_id)
        threading.Thread(target=accept, daemon=True).start()

    def on_message(self, command, arg0, arg1, data) -> None:
        self.writes += command == WRTE

    def on_lost(self, io, error) -> None:
        self.lost = error


def test_a_wrte_before_the_last_was_acknowledged_closes_the_connection():
    got = {}

    def script(sock):
        phone.listening.wait(5)
        sock.sendall(_message(OPEN, 7, 0, b"tcp:9999\0"))
        command, local_id, remote_id, _ = _read_message(sock)
        got["okay"] = (command, remote_id)
        for _ in range(1000):  # a flood: no waiting for the host's OKAY
            sock.sendall(_message(WRTE, 7, local_id, b"x" * 65536))

    taker = _Taker()
    phone = HostilePhone(HOST_MAX_DATA, script)
    try:
        device = _connect(phone.port)
        device.io.listen("tcp:9999", taker)
        phone.listening.set()
        assert _until(lambda: not device.alive), "the connection stayed open"
        assert got["okay"] == (OKAY, 7)
        assert taker.writes == 1 and "before its last one was acknowledged" in str(taker.lost)
    finally:
        phone.close()


def test_1500_opens_get_a_bounded_number_of_streams_and_threads():
    answers = []

    def script(sock):
        phone.listening.wait(5)
        for i in range(1500):
            sock.sendall(_message(OPEN, 1000 + i, 0, b"tcp:9999\0"))
        sock.settimeout(5.0)
        try:
            while True:
                answers.append(_read_message(sock)[0])
        except (OSError, ConnectionError):
            pass

    taker = _Taker()
    phone = HostilePhone(HOST_MAX_DATA, script)
    threads = threading.active_count()
    try:
        device = _connect(phone.port)
        device.io.listen("tcp:9999", taker)
        phone.listening.set()
        peak = 0
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and phone.thread.is_alive():
            peak = max(peak, threading.active_count() - threads)
            time.sleep(0.02)
        assert taker.opened <= MAX_PHONE_STREAMS
        assert peak < MAX_PHONE_STREAMS + 20, f"{peak} threads"
        # The rest were refused (CLSE) or the phone, outrunning the refusals, was cut off.
        refused = answers.count(CLSE)
        assert refused + taker.opened >= 1500 or not device.alive, (refused, taker.opened)
    finally:
        phone.close()


def test_messages_to_streams_nobody_reads_are_not_kept_without_end():
    def script(sock):
        for i in range(64):  # 64 MiB to adb-shell's stream ids, which no command of the host opened
            sock.sendall(_message(WRTE, 5, 100 + i, b"z" * HOST_MAX_DATA))

    phone = HostilePhone(HOST_MAX_DATA, script)
    rss = _rss_mib()
    try:
        device = _connect(phone.port)
        assert _until(lambda: not device.alive), "the connection stayed open"
        assert "to streams nobody reads" in str(device.io.error)
        assert _rss_mib() - rss < 48, f"the host grew {_rss_mib() - rss:.0f} MiB"
    finally:
        phone.close()


@pytest.mark.parametrize("announced", [4096, HOST_MAX_DATA])
def test_a_well_behaved_phone_keeps_its_connection(announced):
    def script(sock):
        phone.listening.wait(5)
        sock.sendall(_message(OPEN, 7, 0, b"tcp:9999\0"))
        _, local_id, _, _ = _read_message(sock)
        for _ in range(5):  # each WRTE after the host's OKAY
            sock.sendall(_message(WRTE, 7, local_id, b"y" * 1000))
            assert _read_message(sock)[0] == OKAY
        time.sleep(1.0)

    class Acker(_Taker):
        def on_open(self, io, remote_id, destination):
            self.io = io
            super().on_open(io, remote_id, destination)

        def on_message(self, command, arg0, arg1, data):
            super().on_message(command, arg0, arg1, data)
            threading.Thread(target=self.io.post, args=(OKAY, arg1, arg0), daemon=True).start()

    taker = Acker()
    phone = HostilePhone(announced, script)
    try:
        device = _connect(phone.port)
        device.io.listen("tcp:9999", taker)
        phone.listening.set()
        assert _until(lambda: taker.writes == 5)
        assert device.alive and device.io.maxdata == announced
    finally:
        phone.close()
