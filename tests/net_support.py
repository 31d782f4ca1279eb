"""Network faults for the tests and the fault suite that break a connection on purpose: a TCP
proxy between a transport and its device that, `cut_after` bytes sent towards the device,
closes both sides (a cable pulled mid-push), or with `freeze()` stops forwarding while keeping
the sockets open (a device that stops answering); and a watcher that looks, while a push runs,
for any file at a final path (a staged bundle file or a store blob) that is not whole; and a
bundle as it was signed before manifests listed chunk hashes (resumed a whole file at a time)."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from pathlib import Path


class Proxy:
    """Forwards 127.0.0.1:`port` (its own port is `.port`); counts the bytes sent towards the
    device in `.forwarded`."""

    def __init__(self, port: int, cut_after: int | None = None):
        self.target, self.cut_after = port, cut_after
        self.forwarded = 0
        self.frozen = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sockets += [client, upstream]
            pair = (client, upstream)
            threading.Thread(target=self._pump, args=(client, upstream, True, pair), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False, pair), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counted: bool, pair: tuple) -> None:
        try:
            while data := src.recv(65536):
                while self.frozen.is_set():
                    time.sleep(0.05)
                if counted and self.cut_after is not None and self.forwarded + len(data) > self.cut_after:
                    dst.sendall(data[: self.cut_after - self.forwarded])
                    self.forwarded = self.cut_after
                    self.close_connections()
                    return
                dst.sendall(data)
                if counted:
                    self.forwarded += len(data)
        except OSError:
            pass
        _close(pair)  # one side hung up: end this connection only (an HTTP client opens many)

    def freeze(self) -> None:
        self.frozen.set()

    def close_connections(self) -> None:
        _close(self.sockets)

    def close(self) -> None:
        self.server.close()
        self.frozen.clear()
        self.close_connections()


def _close(sockets) -> None:
    for s in sockets:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


def partial_files(root: Path, manifest) -> list[str]:
    """Files under the device root `root` at a final path whose content is not whole: a staged
    file of `manifest`'s build whose sha256 is not its entry's, or a store blob whose sha256 is
    not its name (temporary names, which start with a dot, are not final paths)."""
    by_path = {f.path: f.sha256 for f in manifest.files}
    staged, store = root / "incoming" / manifest.build / "files", root / "store"
    bad = [str(p) for p in (staged.rglob("*") if staged.exists() else []) if p.is_file() and
           by_path.get(p.relative_to(staged).as_posix()) != hashlib.sha256(p.read_bytes()).hexdigest()]
    bad += [str(p) for p in (store.rglob("*") if store.exists() else []) if p.is_file() and
            not p.name.startswith(".") and hashlib.sha256(p.read_bytes()).hexdigest() != p.name]
    return bad


class PartialWatcher:
    """`with PartialWatcher(root, manifest) as seen:` polls every 5 ms while the block runs and
    collects in `seen` every partial file it catches at a final path."""

    def __init__(self, root: Path, manifest):
        self.root, self.manifest = root, manifest
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self.seen.extend(partial_files(self.root, self.manifest))
            except OSError:  # a file renamed away while it was read
                pass
            time.sleep(0.005)

    def __enter__(self) -> list[str]:
        self._thread.start()
        return self.seen

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def without_chunks(bundle: Path, out: Path, private_key: Path) -> Path:
    """A copy of `bundle` whose manifest lists no chunk hashes (chunk_size 0), signed again with
    `private_key`: a build made before chunks were listed."""
    import dataclasses
    import shutil

    from agent.bundle import load_private_key
    from agent.protocol import Manifest, from_json, to_json

    shutil.copytree(bundle, out)
    manifest = from_json(Manifest, (bundle / "manifest.json").read_bytes())
    manifest = dataclasses.replace(manifest, chunk_size=0,
                                   files=[dataclasses.replace(f, chunks=[]) for f in manifest.files])
    (out / "manifest.json").write_text(to_json(manifest))
    (out / "manifest.sig").write_bytes(load_private_key(private_key).sign(manifest.canonical_bytes()))
    return out
