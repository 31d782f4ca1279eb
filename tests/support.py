"""What many tests share: a free port on 127.0.0.1, waiting for a condition, and a raw HTTP
receiver that answers however a test says (slowly, endlessly, never). (Faults on a
connection are net_support.py's; the fault tests' workers are orchestrator/worker_farm.py's.)"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the caller binds it soon after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout_s: float = 5.0, every_s: float = 0.05) -> bool:
    """Poll `predicate` until it is truthy (True) or `timeout_s` has passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


class RawReceiver:
    """A socket server in a thread that reads each request's head, then answers its connection
    with `answer(conn)`; `url` is http://127.0.0.1:PORT/hook, `hits` the connections taken.
    `closed` is set by close(): an answer that waits on it holds its connection open till then."""

    def __init__(self, answer: Callable[[socket.socket], object]):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.hits = 0
        self.closed = threading.Event()

        def serve():
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                self.hits += 1
                threading.Thread(target=self._one, args=(conn, answer), daemon=True).start()

        threading.Thread(target=serve, daemon=True).start()

    @staticmethod
    def _one(conn, answer):
        with conn:
            conn.settimeout(30)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            try:
                answer(conn)
            except OSError:
                pass

    def close(self):
        self.closed.set()
        self.sock.close()
