"""Private Redis and PostgreSQL servers for the fault suite and the multi-host tests: a
redis-server whose every write is in its append-only file before it is acknowledged, and a
PostgreSQL cluster made with initdb in a folder of the run's own. Each can run inside a network
namespace (`run_in`, the command prefix netns.Star.run_in gives) and listen on an address other
than loopback; neither ever touches the machine's own servers."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(address: str, port: int, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((address, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not start on {address}:{port}")


def as_postgres_user() -> list[str]:
    """The prefix that runs a command as `postgres` (initdb and postgres refuse root)."""
    if os.getuid() != 0:
        return []
    if subprocess.run(["id", "postgres"], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "postgres"], check=True)
    return ["runuser", "-u", "postgres", "--"]


class RedisServer:
    """A private redis-server in `folder` listening on `listen`:`port` (a free port of this
    namespace when not given); `reach` is the address this process reaches it at."""

    def __init__(self, folder: Path, *, listen: str = "127.0.0.1", port: int | None = None,
                 run_in: list[str] | None = None, reach: str | None = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise SystemExit("no redis-server on PATH (Debian package redis-server)")
        self.folder, self.listen, self.port = folder, listen, port or free_port()
        self.run_in, self.reach = run_in or [], reach or listen
        self.url = self.url_at(self.reach)
        folder.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen | None = None

    def url_at(self, address: str) -> str:
        return f"redis://{address}:{self.port}/0"

    def start(self) -> None:
        # Off loopback it listens only inside a namespace of the run's own: no password needed there.
        protected = [] if self.listen.startswith("127.") else ["--protected-mode", "no"]
        log = open(self.folder / "redis.log", "a")  # noqa: SIM115  (the child keeps it)
        self.process = subprocess.Popen([*self.run_in, self.binary, "--bind", self.listen, "--port", str(self.port),
                                         "--dir", str(self.folder), "--save", "", "--appendonly", "yes",
                                         "--appendfsync", "always", *protected],
                                        stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_port(self.reach, self.port, "redis-server")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


class PostgresServer:
    """A private PostgreSQL cluster made with initdb in `folder`, listening on `listen`:`port`,
    trusting local connections and those from `trust` (a CIDR) when given."""

    def __init__(self, folder: Path, *, listen: str = "127.0.0.1", port: int | None = None,
                 run_in: list[str] | None = None, reach: str | None = None, trust: str | None = None):
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
        if not found:
            raise SystemExit("no PostgreSQL server (Debian package postgresql)")
        self.bin, self.folder, self.listen, self.port = found[-1].parent, folder, listen, port or free_port()
        self.run_in, self.reach = run_in or [], reach or listen
        self.url = self.url_at(self.reach)
        self.user = as_postgres_user()
        folder.mkdir(parents=True, exist_ok=True)
        if self.user:
            shutil.chown(folder, "postgres")
        subprocess.run([*self.user, str(self.bin / "initdb"), "-D", str(folder / "data"), "-U", "postgres",
                        "--auth=trust", "-E", "UTF8"], check=True, capture_output=True)
        if trust:
            with open(folder / "data" / "pg_hba.conf", "a") as hba:
                hba.write(f"host all all {trust} trust\n")

    def url_at(self, address: str) -> str:
        return f"postgresql+psycopg://postgres@{address}:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        done = subprocess.run([*self.run_in, *self.user, str(self.bin / "pg_ctl"), "-D", str(self.folder / "data"),
                               "-l", str(self.folder / "server.log"), "-w", "-t", "60", *args],
                              capture_output=True, text=True)
        if done.returncode != 0:
            log = self.folder / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.is_file() else "(no server.log)"
            raise RuntimeError(f"pg_ctl {args[-1]} failed ({done.returncode}): {done.stderr.strip()}\n"
                               f"--- {log}\n{tail}")

    def start(self, *, any_port: bool = False) -> None:
        """Start the server; with `any_port` (its first start, before anyone knows its address),
        on another free port when its own was taken in the meantime (free_port only finds one
        free at that moment: another test's server may bind it first)."""
        for attempt in range(3 if any_port else 1):
            try:
                self._ctl("-o", f"-h {self.listen} -p {self.port} -k {self.folder} -c fsync=off", "start")
                return
            except RuntimeError as exc:
                if attempt == 2 or not any_port or "already in use" not in str(exc):
                    raise
                self.port = free_port()
                self.url = self.url_at(self.reach)

    def stop(self) -> None:
        self._ctl("-m", "fast", "stop")
