"""Network namespaces for a farm of several hosts on this machine, made with Debian's iproute2
alone: a star with a control namespace `ctl` in the middle, one veth pair between the root
namespace (the test process) and ctl, and one between ctl and each device host. Each link is a
/30 of 10.213.0.0/16. No namespace has a default route and nothing forwards (the machine's
ip_forward is left alone), so a process in a namespace reaches its own loopback and the other
end of its links, nothing else: a device host reaches ctl only, the root namespace reaches ctl
only, and nothing here can reach an address outside them.

Each device host is a machine of its own: `ip netns exec` lays the files of /etc/netns/NAME/
over /etc, and each host gets its own /etc/machine-id there, so the virtual phones of one host
share an adapter group (one GPU: their timed jobs take turns) and those of two hosts do not.

Every name carries PREFIX and the pid of the process that made it. `remove()` takes everything
down (processes left inside first); `remove_stale()` does the same for what an earlier run that
crashed left behind (its pid is gone), so namespaces never pile up."""

from __future__ import annotations

import atexit
import fcntl
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

PREFIX = "dfh"
# The root namespace's end of a run's link is 10.213.K.1, ctl's 10.213.K.2 (K in 1..254, one per
# run alive on this machine); a device host's link is 10.213.0.4i/30 inside the namespaces.
NETWORK = "10.213"
RUN_NETNS = Path("/run/netns")  # where `ip netns add` names namespaces: locked while a run picks its subnet
ETC_NETNS = Path("/etc/netns")  # iproute2's per-namespace /etc (ip-netns(8))
_NAME = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+-")


class NetnsError(RuntimeError):
    """An `ip` command failed; the message quotes it and what it said."""


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` on PATH (Debian package iproute2)"
    return None


def ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(name: str) -> None:
    """Kill what still runs in namespace `name` (only processes of this harness live there), then
    delete it; its veth pairs go with it."""
    for _ in range(50):
        pids = [int(p) for p in ip("netns", "pids", name, check=False).split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    ip("netns", "del", name, check=False)
    shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
    try:
        ETC_NETNS.rmdir()  # only when nothing else is in it
    except OSError:
        pass


def remove_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone; returns their names."""
    names = {line.split()[0] for line in ip("netns", "list", check=False).splitlines() if line.strip()}
    if ETC_NETNS.is_dir():
        names |= {path.name for path in ETC_NETNS.iterdir()}
    stale = sorted(name for name in names if (match := _NAME.match(name)) and not _alive(int(match.group(1))))
    for name in stale:
        _delete_namespace(name)
    return stale


class Star:
    """The namespaces and links of one run: `ctl` and each of `hosts`. `create()` makes them,
    `remove()` (also at exit) takes them down."""

    def __init__(self, hosts: Sequence[str]):
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        self.hosts = list(hosts)
        self.namespaces = {role: f"{self.tag}-{role}" for role in ["ctl", *self.hosts]}
        self.root_link = f"{PREFIX}{secrets.token_hex(4)}"  # 11 characters: the root namespace's end
        self.subnet: int | None = None
        self._created = False

    # ---- addresses ---------------------------------------------------------------------------

    def ctl_address(self, host: str | None = None) -> str:
        """Where ctl is reached from `host`'s namespace (None: from the root namespace)."""
        if host is None:
            return f"{NETWORK}.{self.subnet}.2"
        return f"{NETWORK}.0.{4 * self.hosts.index(host) + 1}"

    def host_address(self, host: str) -> str:
        """`host`'s address on its link to ctl."""
        return f"{NETWORK}.0.{4 * self.hosts.index(host) + 2}"

    def run_in(self, role: str) -> list[str]:
        """The command prefix that runs a program in namespace `role` (ctl or a host)."""
        return ["ip", "netns", "exec", self.namespaces[role]]

    # ---- making and removing -----------------------------------------------------------------

    def create(self) -> Star:
        remove_stale()
        atexit.register(self.remove)
        self._created = True
        for role, name in self.namespaces.items():
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
            if role != "ctl":
                (ETC_NETNS / name).mkdir(parents=True, exist_ok=True)
                (ETC_NETNS / name / "machine-id").write_text(secrets.token_hex(16) + "\n")
        ctl = self.namespaces["ctl"]
        lock = os.open(RUN_NETNS, os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two runs must not pick one subnet
            used = set(re.findall(rf"inet {re.escape(NETWORK)}\.(\d+)\.", ip("-4", "-o", "addr", "show")))
            free = [k for k in range(1, 255) if str(k) not in used]
            if not free:
                raise NetnsError(f"no free {NETWORK}.K.0/30 in the root namespace")
            self.subnet = free[secrets.randbelow(len(free))]
            ip("link", "add", self.root_link, "type", "veth", "peer", "name", "to-root", "netns", ctl)
            ip("addr", "add", f"{NETWORK}.{self.subnet}.1/30", "dev", self.root_link)
            ip("link", "set", self.root_link, "up")
        finally:
            os.close(lock)  # and with it the lock
        ip("-n", ctl, "addr", "add", f"{self.ctl_address()}/30", "dev", "to-root")
        ip("-n", ctl, "link", "set", "to-root", "up")
        for host in self.hosts:
            ns = self.namespaces[host]
            ip("link", "add", f"to-{host}", "netns", ctl, "type", "veth", "peer", "name", "to-ctl", "netns", ns)
            ip("-n", ctl, "addr", "add", f"{self.ctl_address(host)}/30", "dev", f"to-{host}")
            ip("-n", ns, "addr", "add", f"{self.host_address(host)}/30", "dev", "to-ctl")
            ip("-n", ctl, "link", "set", f"to-{host}", "up")
            ip("-n", ns, "link", "set", "to-ctl", "up")
        return self

    def cut(self, host: str) -> None:
        """Cut `host` off ctl (Redis, PostgreSQL, beat and the API): ctl's end of its link goes
        down, and every packet between them is lost until heal()."""
        ip("-n", self.namespaces["ctl"], "link", "set", f"to-{host}", "down")

    def heal(self, host: str) -> None:
        ip("-n", self.namespaces["ctl"], "link", "set", f"to-{host}", "up")

    def remove(self) -> None:
        """Everything create() made, the processes still inside included; safe to call twice."""
        if not self._created:
            return
        self._created = False
        for name in self.namespaces.values():
            _delete_namespace(name)
        ip("link", "del", self.root_link, check=False)  # gone with ctl already, unless ctl was never made

    def __enter__(self) -> Star:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.remove()
