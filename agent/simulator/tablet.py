"""A virtual web device: a browser on the lab's network that opens the farm's HTTPS page itself,
as an iPad's Safari does once a person has opened the enrolment URL. It is this machine's
headless Chromium (WebGPU on SwiftShader where there is no GPU) in a home folder of its own,
whose NSS database trusts the farm's CA, exactly the trust a person installs on a device
(`farm ca export`, then trust it): without that step Chromium refuses the page. The profile
(Cache Storage, the page's enrolment) is kept under `root`, as a device keeps its browser's.

    VirtualTablet(root, ca_pem).open(url)   start (or restart) the browser on url
    .kill()                                 end it at once, as a closed tab
    .close()                                end it

`farm-agent simulate-tablet --url-file FILE --ca CA.pem --root DIR` runs one until SIGTERM (the demo's
stack starts it so)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

from engine.browser import (
    chromium_command,
    default_webgpu_adapter,
    find_chromium,
    launch_page,
    private_log,
)

CA_NICKNAME = "devicefarm CA"


class TabletError(Exception):
    """The tablet cannot run here (no Chromium, no certutil); the message says what to install."""


class VirtualTablet:
    def __init__(self, root: Path, ca_pem: Path, *, chromium: str | None = None, webgpu_adapter: str | None = "auto"):
        self.root = Path(root)
        self.ca_pem = Path(ca_pem)
        self.chromium = chromium or os.environ.get("FARM_CHROMIUM") or find_chromium()
        if not self.chromium:
            raise TabletError("no Chromium: apt-get install chromium (bash scripts/ensure-chromium.sh)")
        self.webgpu_adapter = default_webgpu_adapter() if webgpu_adapter == "auto" \
            else webgpu_adapter
        self.home = self.root / "home"
        self.profile = self.root / "profile"
        self.process: subprocess.Popen | None = None
        self._trust_ca()

    def _trust_ca(self) -> None:
        """The farm's CA in the home folder's NSS database, which Chromium on Linux trusts."""
        certutil = shutil.which("certutil")
        if not certutil:
            raise TabletError("no certutil: apt-get install libnss3-tools (bash scripts/ensure-chromium.sh)")
        nssdb = self.home / ".pki" / "nssdb"
        if not (nssdb / "cert9.db").is_file():
            nssdb.mkdir(parents=True, exist_ok=True)
            _run([certutil, "-N", "-d", f"sql:{nssdb}", "--empty-password"])
        with contextlib.suppress(subprocess.CalledProcessError):  # a CA made again replaces the old one
            _run([certutil, "-D", "-d", f"sql:{nssdb}", "-n", CA_NICKNAME])
        _run([certutil, "-A", "-d", f"sql:{nssdb}", "-n", CA_NICKNAME, "-t", "C,,", "-i", str(self.ca_pem)])

    def open(self, url: str) -> None:
        self.kill()
        self.profile.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME")}
        env["HOME"] = str(self.home)
        # The URL holds the device's token: Chromium is started on a private page that opens it,
        # never with it on its command line; its log is the owner's alone.
        with private_log(self.root / "chromium.log") as log:
            start = launch_page(self.root / "launch", url)
            self.process = subprocess.Popen(chromium_command(self.chromium, self.profile, start, self.webgpu_adapter),
                                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                            start_new_session=True)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        self.process = None

    def close(self) -> None:
        self.kill()

    def __enter__(self) -> VirtualTablet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)
