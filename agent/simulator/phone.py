"""The virtual phone as a whole: it wires a sandbox folder, a phone model, the thermal model,
the shell, the apps (Chrome runs as a headless Chromium), the reverse forwards, the
accepted-keys store and the ADB server together, and runs them on an asyncio loop, either in
a background thread (VirtualPhone.start/stop, for tests) or in the calling thread until
SIGINT/SIGTERM (run_simulator, for `farm-agent simulate` and the demo)."""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from agent.simulator.android import AndroidState
from agent.simulator.apps import CHROME, BrowserSettings, PhoneApps
from agent.simulator.auth import KeyStore
from agent.simulator.device import AdbServer
from agent.simulator.fs import SandboxFS
from agent.simulator.models import get_model
from agent.simulator.reverse import ReverseForwards
from agent.simulator.shell import AGENT_ROOT, AgentSettings, Shell
from agent.simulator.thermal import ThermalModel, ThermalSettings


class VirtualPhone:
    """One simulated Android phone reachable over ADB at host:port.

    root: the sandbox folder (fs/ holds the device files, adb_keys the accepted host keys);
    a temporary folder, removed on stop, when None. auth: require RSA authentication, as a
    phone does (off only for tests that want a phone anyone can reach). adb_keys: a file of
    host public keys the phone trusts (adbkey.pub), as if paired before. accept_new_keys:
    whether an unknown host key is accepted (and persisted) when offered, like tapping
    "Allow" on the phone; when off, an unknown host gets silence. browser: how the phone's
    Chrome runs (a headless Chromium; its profile and log under root/apps/com.android.chrome).

    The phone's own ports live on this machine's: host_port(P) is the host port standing for
    the phone's port P (for a browser on this machine), live while `adb reverse` forwards P."""

    def __init__(self, serial: str = "virtual-0", model: str = "Pixel 7", root: Path | None = None,
                 auth: bool = True, host: str = "127.0.0.1", port: int = 0,
                 accept_new_keys: bool = False, thermal: ThermalSettings | None = None,
                 agent: AgentSettings | None = None, adb_keys: Path | None = None,
                 browser: BrowserSettings | None = None):
        self.serial = serial
        self.model = get_model(model)
        self._own_root = root is None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="virtual-phone-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.auth = auth
        self.accept_new_keys = accept_new_keys
        self.host = host
        self.port = port
        self.thermal = ThermalModel(thermal)
        self.android = AndroidState(self.model, serial, self.thermal, auth)
        self.fs = SandboxFS(self.root, self.android.virtual_files())
        self.reverse = ReverseForwards()  # the phone's localhost is this machine's loopback
        self.apps = PhoneApps(self.root, self.model.packages, self.reverse, browser)
        self.shell = Shell(self.fs, self.android, self.thermal, agent, self.apps)
        self.keys = KeyStore(self.root / "adb_keys", Path(adb_keys) if adb_keys is not None else None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    # ---- running on the current thread -----------------------------------------------------

    async def serve(self, ready: Callable[[int], None] | None = None) -> None:
        """Serve until stop() is called (or the task is cancelled)."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = AdbServer(self, self.host, self.port)
        self.port = await server.start()
        try:
            if ready is not None:
                ready(self.port)
            await self._stop.wait()
        finally:
            await server.close()
            await self.reverse.close()
            await asyncio.to_thread(self.apps.stop)

    # ---- the phone's ports and apps, seen from this machine -----------------------------------

    def host_port(self, phone_port: int) -> int:
        """The host port standing for the phone's `phone_port`: it reaches what `adb reverse`
        forwards there, and is refused while nothing is; the same for the phone's lifetime."""
        return self.reverse.host_port(phone_port)

    def host_url(self, url: str) -> str:
        """A URL on the phone's localhost as this machine reaches it (others unchanged)."""
        return self.reverse.host_url(url)

    def forwards(self) -> dict[int, str]:
        """The reverse forwards in place: phone port -> what the host is asked to open."""
        return self.reverse.forwarded()

    def browser_running(self, package: str = CHROME) -> bool:
        return self.apps.running(package)

    def kill_browser(self, package: str = CHROME) -> None:
        """Kill the browser at once, as Android ends a tab it needs the memory of (a test hook)."""
        self.apps.kill(package)

    # ---- running on a background thread ---------------------------------------------------

    def start(self) -> int:
        """Start serving on a background thread; returns the listening port."""
        started = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(self.serve(ready=lambda _: started.set()))
            except BaseException as exc:  # reported to start()'s caller
                errors.append(exc)
                started.set()

        self._thread = threading.Thread(target=run, name=f"virtual-phone-{self.serial}", daemon=True)
        self._thread.start()
        started.wait()
        if errors:
            raise errors[0]
        return self.port

    def stop_soon(self) -> None:
        """Ask serve() to return; safe from any thread and from a signal handler."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)

    def stop(self) -> None:
        """Stop serving, wait for the background thread, remove a temporary root."""
        self.stop_soon()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> VirtualPhone:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


TRUST_POLL_S = 1.0


def _provision_when_present(phone: VirtualPhone, trust: Path, stop_event: threading.Event | None) -> None:
    from agent.bundle import provision_public_key

    target = phone.fs.host_path(AGENT_ROOT)
    if trust.is_file():
        provision_public_key(target, trust)
        return

    def wait() -> None:
        while not trust.is_file():
            if stop_event is not None and stop_event.is_set():
                return
            time.sleep(TRUST_POLL_S)
        provision_public_key(target, trust)

    threading.Thread(target=wait, name=f"trust-{phone.serial}", daemon=True).start()


def run_simulator(port: int, serial: str, model: str = "Pixel 7", root: Path | None = None,
                  auth: bool = True, host: str = "127.0.0.1",
                  ready: Callable[[int], None] | None = None, *,
                  stop_event: threading.Event | None = None, trust: Path | None = None,
                  adb_keys: Path | None = None, accept_new_keys: bool = False) -> None:
    """Serve one virtual phone on host:port (0 picks a free port; `ready(port)` is called once
    it listens) until SIGINT or SIGTERM (on the main thread) or until `stop_event` is set.
    `trust` is a farm public key to provision in the phone's agent root, as an operator
    does once per real phone; until that file exists (a farm that has not made its key yet)
    the phone serves without it and provisions it as soon as it appears. `auth`, `adb_keys`
    and `accept_new_keys` are VirtualPhone's."""
    phone = VirtualPhone(serial=serial, model=model, root=root, auth=auth, host=host, port=port,
                         adb_keys=adb_keys, accept_new_keys=accept_new_keys)
    if trust is not None:
        _provision_when_present(phone, Path(trust), stop_event)

    async def watch(event: threading.Event) -> None:
        while not event.is_set():  # polled: a thread blocked in wait() would outlive the loop
            await asyncio.sleep(0.1)
        phone.stop_soon()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, phone.stop_soon)
        watcher = asyncio.ensure_future(watch(stop_event)) if stop_event is not None else None
        try:
            await phone.serve(ready)
        finally:
            if watcher is not None:
                watcher.cancel()

    try:
        asyncio.run(main())
    finally:
        if phone._own_root:
            shutil.rmtree(phone.root, ignore_errors=True)


def auth_note(auth: bool, adb_keys: Path | None, accept_new_keys: bool) -> str:
    """What a phone's "listening" line says about who may connect."""
    if not auth:
        return " (no authentication)"
    if accept_new_keys:
        return " (accepts any new host key)"
    if adb_keys is None:
        return " (only hosts already in its adb_keys: give --adb-keys)"
    return ""
