"""The page hosts' file sender (engine.pagehost.send_file: the hub's /blobs, the engine page's
weights and shaders) streams: a file asked for whole, or a long range of it, is never read into
memory at once (a 1.7 GB weight file would be), and the bytes and ranges are exact."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import tracemalloc
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.pagehost import send_file

SIZE = 48 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("blobs")
    data = os.urandom(1 << 20) * (SIZE >> 20)
    (root / "big.bin").write_bytes(data)
    served = queue.Queue()  # what each send_file call returned, in the server's thread

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            served.put(send_file(self, root, self.path.lstrip("/")))

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", hashlib.sha256(data).hexdigest(), data[:4096], served
    httpd.shutdown()


def _read(url: str, headers: dict | None = None) -> tuple[int, str, int, bytes]:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {})) as r:
        h, n, head = hashlib.sha256(), 0, b""
        while piece := r.read(1 << 20):
            h.update(piece)
            head = head or piece[:64]
            n += len(piece)
        return r.status, h.hexdigest(), n, head


def test_a_whole_file_is_streamed_not_read_into_memory(server):
    url, digest, _, served = server
    tracemalloc.start()
    try:
        status, got, n, _ = _read(f"{url}/big.bin")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # send_file returns after its last byte is on the wire: the client can finish reading first
    assert (status, got, n, served.get(timeout=30)) == (200, digest, SIZE, SIZE)
    assert peak < 8 << 20, f"serving a {SIZE:,}-byte file took {peak:,} bytes of memory at its peak"


def test_a_range_is_exact(server):
    url, _, head, served = server
    status, got, n, first = _read(f"{url}/big.bin", {"Range": "bytes=100-2147"})
    assert (status, n, served.get(timeout=30)) == (206, 2048, 2048)
    assert got == hashlib.sha256(head[100:2148]).hexdigest() and first == head[100:164]
    with pytest.raises(urllib.error.HTTPError) as bad:
        _read(f"{url}/big.bin", {"Range": f"bytes={SIZE}-"})
    assert bad.value.code == 416
