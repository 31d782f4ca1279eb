"""The device side of ADB over TCP: one asyncio task per connection reads messages, does the
CNXN/AUTH handshake, and multiplexes streams (OPEN/OKAY/WRTE/CLSE) onto services: shell v1
and v2, exec, sync, root and reverse (agent/simulator/reverse.py). Flow control follows adbd:
one WRTE in flight per direction and stream; a host WRTE is acknowledged when the service
takes its data; the device closes a stream only after its last WRTE is acknowledged; a CLSE
from the host for an open stream is echoed and cancels the service (which kills a running
agent). Streams can also start on the device (open_stream: adbd's reverse listeners do
this): OPEN(local, 0, destination), answered by the host's OKAY or CLSE."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct

from agent.simulator import wire
from agent.simulator.apps import CHROME
from agent.simulator.auth import KeyFormatError
from agent.simulator.shellio import IO, StreamStdin
from agent.simulator.sync import SyncEnd, SyncService

log = logging.getLogger("agent.simulator")

SHELL_STDIN, SHELL_STDOUT, SHELL_STDERR, SHELL_EXIT, SHELL_CLOSE_STDIN, SHELL_WINDOW = range(6)
SHELL_PACKET = struct.Struct("<BI")
DEVTOOLS_SOCKET = "chrome_devtools_remote"  # Chrome's DevTools, an abstract socket on a phone


class StreamClosed(Exception):
    pass


class Stream:
    def __init__(self, conn: Connection, local_id: int, remote_id: int):
        self.conn = conn
        self.local_id = local_id
        self.remote_id = remote_id
        self.inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.acked = asyncio.Event()
        self.acked.set()
        self.closed = False
        self.task: asyncio.Task | None = None
        self.opened: asyncio.Future | None = None  # a device-initiated stream until the host answers
        self.lost = False  # the connection ended under the stream (not a CLSE from the host)
        self._pending = b""

    async def write(self, data: bytes) -> None:
        for i in range(0, len(data), self.conn.maxdata):
            # One WRTE in flight per stream (ADB's flow control). The host's OKAY wakes every
            # writer of the stream (shell v2's stdout and stderr pumps): only the first may send,
            # the others wait for the OKAY of its WRTE.
            while not self.acked.is_set():
                await self.acked.wait()
            if self.closed:
                raise StreamClosed()
            self.acked.clear()
            await self.conn.send(wire.Message(wire.WRTE, self.local_id, self.remote_id, data[i:i + self.conn.maxdata]))

    async def read(self) -> bytes | None:
        """The next chunk the host wrote (acknowledged now), or None once the host closed."""
        chunk = await self.inbox.get()
        if chunk is None:
            self.inbox.put_nowait(None)
            return None
        if not self.closed:
            await self.conn.send(wire.Message(wire.OKAY, self.local_id, self.remote_id))
        return chunk

    async def read_exact(self, n: int) -> bytes:
        while len(self._pending) < n:
            chunk = await self.read()
            if chunk is None:
                raise SyncEnd("stream closed")
            self._pending += chunk
        data, self._pending = self._pending[:n], self._pending[n:]
        return data

    async def close(self) -> None:
        """Device-side close, after the last WRTE is acknowledged."""
        if self.closed:
            return
        await self.acked.wait()
        if self.closed:
            return
        self.closed = True
        self.conn.streams.pop(self.local_id, None)
        await self.conn.send(wire.Message(wire.CLSE, self.local_id, self.remote_id))

    def host_closed(self) -> None:
        self.closed = True
        self.acked.set()
        self.inbox.put_nowait(None)
        if self.opened is not None and not self.opened.done():
            self.opened.set_result(False)


class Connection:
    def __init__(self, phone, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.phone = phone
        self.reader = reader
        self.writer = writer
        self.version = wire.VERSION_SKIP_CHECKSUM
        self.maxdata = wire.MAX_PAYLOAD_V1
        self.online = False
        self.token = b""
        self.streams: dict[int, Stream] = {}
        self.next_id = 1
        self._send_lock = asyncio.Lock()
        sock = writer.get_extra_info("socket")
        # adbd names a TCP transport after its socket (`adb reverse --list` shows it)
        self.serial = f"host-{sock.fileno() if sock is not None else 0}"

    async def send(self, msg: wire.Message) -> None:
        async with self._send_lock:
            self.writer.write(wire.pack(msg, self.version))
            await self.writer.drain()

    async def serve(self) -> None:
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                header = await self.reader.readexactly(wire.HEADER.size)
                command, arg0, arg1, length, check = wire.unpack_header(header)
                if length > wire.MAX_PAYLOAD:
                    raise wire.WireError(f"payload of {length} bytes exceeds {wire.MAX_PAYLOAD}")
                data = await self.reader.readexactly(length) if length else b""
                if self.online and self.version < wire.VERSION_SKIP_CHECKSUM and wire.checksum(data) != check:
                    raise wire.WireError(f"bad checksum on {wire.COMMANDS[command]}")
                await self.handle(wire.Message(command, arg0, arg1, data))
        except (asyncio.IncompleteReadError, ConnectionError, wire.WireError) as exc:
            log.debug("connection ended: %s", exc)
        finally:
            self.online = False  # no device-initiated stream starts on a connection that ended
            for s in list(self.streams.values()):
                s.lost = True
                s.host_closed()
                if s.task:
                    s.task.cancel()
            self.phone.reverse.connection_closed(self)  # its forwards end with it, as adbd's do
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()

    # ---- handshake ---------------------------------------------------------------------------

    async def handle(self, msg: wire.Message) -> None:
        if msg.command == wire.CNXN:
            self.version = min(msg.arg0, wire.VERSION_SKIP_CHECKSUM)
            if self.version < wire.VERSION_MIN:
                raise wire.WireError(f"host protocol version {msg.arg0:#x} is too old")
            self.maxdata = min(msg.arg1, wire.MAX_PAYLOAD) or wire.MAX_PAYLOAD_V1
            self.online = False
            if self.phone.auth:
                await self._send_token()
            else:
                await self._go_online()
        elif msg.command == wire.AUTH and self.phone.auth and self.token and not self.online:
            await self._auth(msg)
        elif not self.online:
            return  # nothing but the handshake before CNXN (and AUTH)
        elif msg.command == wire.OPEN:
            await self._open(msg)
        elif msg.command in (wire.OKAY, wire.WRTE, wire.CLSE):
            stream = self.streams.get(msg.arg1)
            if stream is None or stream.remote_id not in (msg.arg0, 0):
                return  # a stream already closed (e.g. the echo of our CLSE)
            if stream.opened is not None and not stream.opened.done():
                self._opened(stream, msg)
                return
            if msg.command == wire.OKAY:
                stream.acked.set()
            elif msg.command == wire.WRTE:
                stream.inbox.put_nowait(msg.data)
            else:
                self.streams.pop(stream.local_id, None)
                stream.host_closed()
                await self.send(wire.Message(wire.CLSE, stream.local_id, stream.remote_id))
                if stream.task:
                    stream.task.cancel()

    async def _send_token(self) -> None:
        self.token = os.urandom(wire.TOKEN_SIZE)
        await self.send(wire.Message(wire.AUTH, wire.AUTH_TOKEN, 0, self.token))

    async def _auth(self, msg: wire.Message) -> None:
        if msg.arg0 == wire.AUTH_SIGNATURE:
            if self.phone.keys.verify_any(self.token, msg.data):
                await self._go_online()
            else:
                await self._send_token()
        elif msg.arg0 == wire.AUTH_RSAPUBLICKEY:
            if not self.phone.accept_new_keys:
                log.info("refused a new host key (accept_new_keys is off)")
                return  # a refusal is silence: the host times out, as with a dismissed dialog
            try:
                self.phone.keys.add(msg.data.decode("utf-8", "replace"))
            except KeyFormatError as exc:
                log.warning("ignored a malformed host key: %s", exc)
                return
            await self._go_online()

    async def _go_online(self) -> None:
        self.online = True
        self.token = b""
        await self.send(wire.Message(wire.CNXN, self.version, self.maxdata, self.phone.android.banner()))

    # ---- streams and services ------------------------------------------------------------------

    async def open_stream(self, destination: str, timeout_s: float) -> Stream | None:
        """A stream the device starts, to `destination` on the host ("tcp:8080"): the stream once
        the host answers OKAY, None when it answers CLSE (nothing there), does not answer within
        `timeout_s`, or the connection ends first."""
        if not self.online:
            return None
        stream = Stream(self, self.next_id, 0)
        self.next_id += 1
        stream.opened = asyncio.get_running_loop().create_future()
        self.streams[stream.local_id] = stream
        await self.send(wire.Message(wire.OPEN, stream.local_id, 0, destination.encode() + b"\0"))
        try:
            if await asyncio.wait_for(asyncio.shield(stream.opened), timeout_s):
                return stream
        except TimeoutError:
            log.warning("the host did not answer OPEN %r within %g s", destination, timeout_s)
        self.streams.pop(stream.local_id, None)
        stream.closed = True
        return None

    @staticmethod
    def _opened(stream: Stream, msg: wire.Message) -> None:
        """The host's answer to a device-initiated OPEN: OKAY(host id, ours) or CLSE(0, ours)."""
        if msg.command == wire.OKAY and msg.arg0:
            stream.remote_id = msg.arg0
            stream.opened.set_result(True)
        elif msg.command == wire.CLSE:
            stream.conn.streams.pop(stream.local_id, None)
            stream.closed = True
            stream.opened.set_result(False)

    async def _open(self, msg: wire.Message) -> None:
        service = msg.data.rstrip(b"\0").decode("utf-8", "replace")
        runner = self._service(service)
        if runner is None:
            await self.send(wire.Message(wire.CLSE, 0, msg.arg0))
            return
        stream = Stream(self, self.next_id, msg.arg0)
        self.next_id += 1
        self.streams[stream.local_id] = stream
        await self.send(wire.Message(wire.OKAY, stream.local_id, stream.remote_id))
        stream.task = asyncio.ensure_future(self._run_service(stream, runner))

    def _service(self, service: str):
        name, _, arg = service.partition(":")
        kind, *options = name.split(",")
        if kind == "shell":
            if "v2" in options:
                return lambda s: self._shell_v2(s, arg, pty="pty" in options)
            return lambda s: self._shell_v1(s, arg)
        if kind == "exec":
            return lambda s: self._shell_v1(s, arg, interactive_ok=False)
        if kind == "sync" and not arg:
            return self._sync
        if kind == "root":
            return self._root
        if kind == "reverse":
            return lambda s: self._reverse(s, arg)
        if kind == "localabstract" and arg == DEVTOOLS_SOCKET:
            port = self.phone.apps.devtools_port(CHROME) if self.phone.apps is not None else None
            return None if port is None else (lambda s: self._relay(s, port))
        return None

    async def _run_service(self, stream: Stream, runner) -> None:
        try:
            await runner(stream)
            await stream.close()
        except (StreamClosed, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("service failed on stream %d", stream.local_id)
            with contextlib.suppress(Exception):
                await stream.close()

    async def _pump_stdin(self, stream: Stream, stdin: StreamStdin) -> None:
        while (chunk := await stream.read()) is not None:
            stdin.queue.put_nowait(chunk)
        stdin.queue.put_nowait(None)

    async def _shell_v1(self, stream: Stream, command: str, interactive_ok: bool = True) -> None:
        stdin = StreamStdin()
        pump = asyncio.ensure_future(self._pump_stdin(stream, stdin))
        io = IO(stdin, stream.write, stream.write)
        try:
            if command.strip() or not interactive_ok:
                await self.phone.shell.run(command, io)
            else:
                await self.phone.shell.interactive(stdin, io, prompt=True)
        finally:
            pump.cancel()

    async def _shell_v2(self, stream: Stream, command: str, pty: bool) -> None:
        stdin = StreamStdin()

        async def packets() -> None:
            buf = b""
            while (chunk := await stream.read()) is not None:
                buf += chunk
                while len(buf) >= SHELL_PACKET.size:
                    kind, length = SHELL_PACKET.unpack_from(buf)
                    if len(buf) < SHELL_PACKET.size + length:
                        break
                    data, buf = buf[5:5 + length], buf[5 + length:]
                    if kind == SHELL_STDIN:
                        stdin.queue.put_nowait(data)
                    elif kind == SHELL_CLOSE_STDIN:
                        stdin.queue.put_nowait(None)
            stdin.queue.put_nowait(None)

        def writer(kind: int):
            async def write(data: bytes) -> None:
                step = max(1, self.maxdata - SHELL_PACKET.size)
                for i in range(0, len(data), step):
                    part = data[i:i + step]
                    await stream.write(SHELL_PACKET.pack(kind, len(part)) + part)
            return write

        pump = asyncio.ensure_future(packets())
        io = IO(stdin, writer(SHELL_STDOUT), writer(SHELL_STDERR))
        try:
            if command.strip():
                code = await self.phone.shell.run(command, io)
            else:
                code = await self.phone.shell.interactive(stdin, io, prompt=pty)
            await stream.write(SHELL_PACKET.pack(SHELL_EXIT, 1) + bytes([code & 0xFF]))
        finally:
            pump.cancel()

    async def _sync(self, stream: Stream) -> None:
        await SyncService(self.phone.fs, stream.read_exact, stream.write, self.maxdata).run()

    async def _root(self, stream: Stream) -> None:
        await stream.write(b"adbd cannot run as root in production builds\n")

    async def _relay(self, stream: Stream, port: int) -> None:
        """Chrome's DevTools socket: the stream relayed both ways to the browser's loopback port."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return  # Chrome went away: the stream closes

        async def to_browser() -> None:
            while (chunk := await stream.read()) is not None:
                writer.write(chunk)
                await writer.drain()
            writer.close()

        pump = asyncio.ensure_future(to_browser())
        try:
            while data := await reader.read(max(1, self.maxdata)):
                await stream.write(data)
        finally:
            pump.cancel()
            writer.close()

    async def _reverse(self, stream: Stream, command: str) -> None:
        await stream.write(await self.phone.reverse.handle(command, self))


class AdbServer:
    """Accepts ADB connections for one phone; `phone` supplies fs, shell, android, keys and
    the auth policy."""

    def __init__(self, phone, host: str, port: int):
        self.phone = phone
        self.host = host
        self.port = port
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, self.host, self.port,
                                                  limit=wire.MAX_PAYLOAD * 2)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def _accept(self, reader, writer) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            await Connection(self.phone, reader, writer).serve()
        except asyncio.CancelledError:
            pass  # the server is closing; asyncio would log a cancelled client task as an error
        finally:
            self._connections.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._connections):
            t.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

