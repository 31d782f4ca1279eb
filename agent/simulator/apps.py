"""The phone's apps as `am`, `pm`, `svc power` and `input` see them (agent/simulator/shell.py
parses those commands): the installed packages (the phone model's list), intents in Android's
notation, the power and wake state those commands set, and the one app that runs for real,
Chrome. `am start` on a web URL opens it in this machine's headless Chromium, with the
engine's launch flags (engine.browser.chromium_command) and a profile kept under the phone's
root, so Cache Storage survives page re-opens as it does on a phone. A URL on the phone's
localhost:P is opened on the host port that stands for P (agent/simulator/reverse.py): the
farm's page when P is reverse-forwarded, a refused connection when it is not. Each app is one
process group; starting an app again replaces it, force-stop and kill end it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.simulator.reverse import ReverseForwards

CHROME = "com.android.chrome"
BROWSERS = (CHROME,)
ACTION_VIEW = "android.intent.action.VIEW"
ACTION_MAIN = "android.intent.action.MAIN"
FLAG_ACTIVITY_NEW_TASK = 0x10000000  # am adds it before starting
WEB_SCHEMES = ("http", "https")
DEVTOOLS_PORT_FILE = "DevToolsActivePort"  # in a Chromium profile: the DevTools port, then its path
# `svc power stayon` values -> Settings.Global.STAY_ON_WHILE_PLUGGED_IN (BatteryManager plug bits)
STAY_ON = {"false": 0, "ac": 1, "usb": 2, "wireless": 4, "true": 7}
# am start options that take no value, and those that take one or two (which the phone ignores)
FLAG_OPTIONS = {"-W", "-S", "-D", "-N", "--streaming", "--track-allocation", "--task-overlay", "--lock-task",
                "--grant-read-uri-permission", "--grant-write-uri-permission", "--grant-persistable-uri-permission",
                "--grant-prefix-uri-permission", "--debug-log-resolution", "--exclude-stopped-packages",
                "--include-stopped-packages", "--receiver-registered-only", "--receiver-replace-pending",
                "--receiver-foreground", "--receiver-no-abort", "--selector"}
VALUE_OPTIONS = {"-P", "--start-profiler", "--sampling", "--attach-agent", "-R", "--user", "--display",
                 "--windowingMode", "--activityType", "--task", "--receiver-permission", "-i", "--esn"}
EXTRA_OPTIONS = {"-e", "--es", "--ez", "--ei", "--el", "--ef", "--eu", "--ecn", "--eia", "--eial", "--ela",
                 "--elal", "--efa", "--efal", "--esa", "--esal", "--ed", "--eda", "--edal"}


class AppError(Exception):
    """An app could not run on this host (no Chromium); the message says what to install."""


@dataclass(frozen=True)
class BrowserSettings:
    """How the phone's Chrome is run: `chromium` (None: $FARM_CHROMIUM, then chromium on PATH),
    its WebGPU adapter ("auto": $FARM_BROWSER_WEBGPU_ADAPTER, else the engine's choice,
    SwiftShader on a host without a GPU; None: Chromium's default), and how long a stopped
    browser gets after SIGTERM before SIGKILL."""

    chromium: str | None = None
    webgpu_adapter: str | None = "auto"
    kill_grace_s: float = 5.0


@dataclass
class Intent:
    action: str | None = None
    data: str | None = None
    mime: str | None = None
    categories: list[str] = field(default_factory=list)
    flags: int = 0
    package: str | None = None
    component: tuple[str, str] | None = None  # (package, full class name)

    def __str__(self) -> str:
        """Intent.toString(): `Intent { act=... dat=... }`, the data shown as toSafeString does."""
        parts = []
        if self.action:
            parts.append(f"act={self.action}")
        if self.categories:
            parts.append(f"cat=[{','.join(self.categories)}]")
        if self.data:
            parts.append(f"dat={safe_uri(self.data)}")
        if self.mime:
            parts.append(f"typ={self.mime}")
        if self.flags:
            parts.append(f"flg={self.flags:#x}")
        if self.package:
            parts.append(f"pkg={self.package}")
        if self.component:
            parts.append(f"cmp={flatten_short(*self.component)}")
        return "Intent { " + " ".join(parts) + " }"


def safe_uri(uri: str) -> str:
    """Uri.toSafeString(): web URLs keep scheme, host and port only; others mask their text."""
    scheme, colon, rest = uri.partition(":")
    if not colon:
        return uri
    if scheme.lower() in ("http", "https", "ftp", "rtsp"):
        parts = urllib.parse.urlsplit(uri)
        port = f":{parts.port}" if parts.port is not None else ""
        return f"{scheme}://{parts.hostname or ''}{port}/..."
    return scheme + ":" + "".join(c if c in "-@." else "x" for c in rest)


def parse_component(text: str) -> tuple[str, str] | None:
    """ComponentName.unflattenFromString: "pkg/.Cls" or "pkg/full.Cls" -> (pkg, full class)."""
    package, slash, cls = text.partition("/")
    if not slash or not package or not cls:
        return None
    return package, package + cls if cls.startswith(".") else cls


def flatten_short(package: str, cls: str) -> str:
    """ComponentName.flattenToShortString: the class relative to the package where it can be."""
    if cls.startswith(package + ".") and len(cls) > len(package) + 1:
        return f"{package}/{cls[len(package):]}"
    return f"{package}/{cls}"


def parse_intent(args: list[str]) -> Intent:
    """`am start`'s intent arguments (Intent.parseCommandArgs): options, then at most one word,
    which is data when it has a ':', a component when it has a '/', else a package. ValueError
    carries am's error text."""
    intent = Intent()
    it = iter(args)
    rest: list[str] = []
    for arg in it:
        if not arg.startswith("-") or rest:
            rest.append(arg)
            continue

        def value(opt: str = arg) -> str:
            v = next(it, None)
            if v is None:
                raise ValueError(f"Error: Argument expected after \"{opt}\"")
            return v

        if arg == "-a":
            intent.action = value()
        elif arg == "-d":
            intent.data = value()
        elif arg == "-t":
            intent.mime = value()
        elif arg == "-c":
            intent.categories.append(value())
        elif arg == "-p":
            intent.package = value()
        elif arg == "-n":
            text = value()
            intent.component = parse_component(text)
            if intent.component is None:
                raise ValueError(f"Error: Bad component name: {text}")
        elif arg == "-f":
            text = value()
            try:
                intent.flags |= int(text, 0)
            except ValueError:
                raise ValueError(f"Error: Bad flags: {text}") from None
        elif arg in EXTRA_OPTIONS:  # a key and a value
            value()
            value()
        elif arg in VALUE_OPTIONS:
            value()
        elif arg in FLAG_OPTIONS or arg.startswith("--activity-"):
            pass
        else:
            raise ValueError(f"Error: Unknown option: {arg}")
    if len(rest) > 1:
        raise ValueError(f"Error: Unexpected argument: {rest[1]}")
    if rest:
        word = rest[0]
        if ":" in word:
            intent.data = word
            intent.action = intent.action or ACTION_VIEW
        elif "/" in word:
            intent.component = parse_component(word)
            if intent.component is None:
                raise ValueError(f"Error: Bad component name: {word}")
        else:
            intent.package = word
    return intent


class PhoneApps:
    """The installed packages, the power state and the running apps of one phone. The methods
    that start or stop processes block (the shell calls them in a thread); all are thread-safe."""

    def __init__(self, root: Path, packages: tuple[str, ...], reverse: ReverseForwards,
                 settings: BrowserSettings | None = None):
        self.root = Path(root)
        self.packages = packages
        self.reverse = reverse
        self.settings = settings or BrowserSettings()
        self.stay_on = 0  # Settings.Global.STAY_ON_WHILE_PLUGGED_IN, as `svc power stayon` sets it
        self.awake = True
        self.key_events: list[str] = []  # what `input keyevent` was given, in order
        self._adapter: str | None = None
        self._adapter_known = False
        self._processes: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def installed(self, package: str) -> bool:
        return package in self.packages

    def app_dir(self, package: str) -> Path:
        """Where an app keeps its data on the host: profile/ (Chrome's) and chromium.log."""
        return self.root / "apps" / package

    # ---- am start ---------------------------------------------------------------------------------

    def resolve(self, intent: Intent) -> tuple[str | None, str]:
        """(the package that takes `intent`, "") or (None, am's error text)."""
        if intent.component is not None:
            package, cls = intent.component
            if not self.installed(package):
                return None, f"Error type 3\nError: Activity class {{{package}/{cls}}} does not exist.\n"
            return package, ""
        web = intent.data is not None and urllib.parse.urlsplit(intent.data).scheme.lower() in WEB_SCHEMES
        candidates = [intent.package] if intent.package else list(BROWSERS)
        for package in candidates:
            if not self.installed(package):
                continue
            if package in BROWSERS and ((intent.action in (None, ACTION_VIEW) and web) or
                                        (intent.action == ACTION_MAIN and intent.data is None)):
                return package, ""
            if package not in BROWSERS and intent.action == ACTION_MAIN and intent.data is None:
                return package, ""  # its launcher activity: nothing the virtual phone runs
        shown = Intent(intent.action, intent.data, intent.mime, intent.categories,
                       intent.flags | FLAG_ACTIVITY_NEW_TASK, intent.package)
        return None, f"Error: Activity not started, unable to resolve {shown}\n"

    def start(self, package: str, intent: Intent) -> None:
        """Start `package` for `intent`, replacing it if it runs. Only browsers run: Chrome opens
        the intent's URL (about:blank without one) in a fresh headless Chromium."""
        if package not in BROWSERS:
            return
        url = intent.data if intent.data is not None else "about:blank"
        self._launch(package, self.reverse.host_url(url))

    def _launch(self, package: str, url: str) -> None:
        from engine.browser import chromium_command, find_chromium, launch_page, private_log

        chromium = self.settings.chromium or os.environ.get("FARM_CHROMIUM") or find_chromium()
        if not chromium:
            raise AppError("the virtual phone runs Chrome as this host's Chromium, and there is none "
                           "(apt-get install chromium, or set FARM_CHROMIUM)")
        adapter = self._webgpu_adapter()
        folder = self.app_dir(package)
        (folder / "profile").mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._stop_locked(package)
            (folder / "profile" / DEVTOOLS_PORT_FILE).unlink(missing_ok=True)  # the last run's port
            # An enrolment URL carries the page's token: never on Chromium's command line (every
            # user of the machine reads those) nor whole in the log.
            with private_log(folder / "chromium.log") as log:
                log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} am start {url.split('#', 1)[0]}\n".encode())
                log.flush()
                command = chromium_command(chromium, folder / "profile", launch_page(folder / "launch", url), adapter)
                # DevTools on a free port of this host's loopback, which the phone's
                # localabstract:chrome_devtools_remote relays to, as Chrome on a phone serves it
                # on that abstract socket (agent/simulator/device.py).
                self._processes[package] = subprocess.Popen(
                    [*command[:-1], "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                     command[-1]],
                    stdout=log,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def _webgpu_adapter(self) -> str | None:
        if self.settings.webgpu_adapter != "auto":
            return self.settings.webgpu_adapter
        if not self._adapter_known:  # the engine's own choice, kept in one place
            from engine.browser import default_webgpu_adapter

            self._adapter = default_webgpu_adapter()
            self._adapter_known = True
        return self._adapter

    def devtools_port(self, package: str) -> int | None:
        """The loopback port of the running browser's DevTools (Chromium writes it to its
        profile's DevToolsActivePort once it listens), or None."""
        if not self.running(package):
            return None
        try:
            first = (self.app_dir(package) / "profile" / DEVTOOLS_PORT_FILE).read_text().split("\n", 1)[0]
        except OSError:
            return None
        return int(first) if first.strip().isdigit() else None

    # ---- stopping ---------------------------------------------------------------------------------

    def running(self, package: str) -> bool:
        with self._lock:
            proc = self._processes.get(package)
            return proc is not None and proc.poll() is None

    def force_stop(self, package: str) -> None:
        """`am force-stop`: SIGTERM, then SIGKILL after the grace time; nothing when not running."""
        with self._lock:
            self._stop_locked(package)

    def kill(self, package: str) -> None:
        """SIGKILL at once, as Android's low-memory killer ends a tab (a test's hook)."""
        with self._lock:
            proc = self._processes.pop(package, None)
            if proc is not None:
                _end_group(proc, (signal.SIGKILL,), self.settings.kill_grace_s)

    def stop(self) -> None:
        """Stop every app (the phone is shutting down)."""
        with self._lock:
            for package in list(self._processes):
                self._stop_locked(package)

    def _stop_locked(self, package: str) -> None:
        proc = self._processes.pop(package, None)
        if proc is not None:
            _end_group(proc, (signal.SIGTERM, signal.SIGKILL), self.settings.kill_grace_s)


def _end_group(proc: subprocess.Popen, signals: tuple[int, ...], grace_s: float) -> None:
    """Signal `proc`'s process group until none of it is left (Chromium's renderers and GPU
    process too: a new Chromium on the same profile must not find the old one alive)."""
    for sig in signals:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()
            if not _group_alive(proc.pid):
                return
            time.sleep(0.05)
    proc.poll()


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is in group `pgid`. /proc is read because a zombie
    renderer nobody reaps (PID 1 in a container may not) would keep killpg(pgid, 0) succeeding."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False
