"""The browser executor's transport: a device whose engine runs in its web browser (an Android
phone's Chrome, an iPhone's Safari), which has WebGPU but no Python. The job's logic runs in a
`farm-agent` on this host, in an agent root of the device's own (<data_dir>/devices/<serial>),
exactly as for a local device: the same lock, time limit, JobSpec and JobResult. Its engine is
the browser executor (the JobSpec's executor "browser"): every plan runs in the device's page, reached
through the farm's hub (orchestrator/transports/hub.py).

A deploy installs the signed build in the host-side root (the agent verifies it), then hands
the page the signed manifest: the page verifies the signature with WebCrypto and keeps the
shaders and weights it lacks in its cache, a signed chunk at a time (a cut deploy resumes from
its last whole chunk), so a re-deploy of an unchanged build sends nothing; the deploy's progress
event says how many chunks came, what the page freed and whether its storage is persistent. A job's plans run from that verified copy.

How the page is reached is a PageLink: over ADB (AdbPageLink: a reverse forward makes the hub
the phone's http://localhost:PORT, a secure context, and an intent opens the page in the
browser), with no dependence on the phone's Wi-Fi. The device's own readings (model, OS, thermal
zones, battery) come from the link, not from the host that runs the agent.

A page that stops answering mid-job (tab killed, screen off, device lost) ends the job as an
infrastructure failure (InfraFailure: the task retries it), never as the job's own failure. A
page whose browser deleted the site's storage (Safari does after 7 days without a person's
visit) has lost its enrolment: it puts back what it still holds in memory, and one loaded
afterwards, refused by the hub, is enrolled again by opening its enrolment URL (over ADB) or
named with the command that prints that URL (a web device)."""

from __future__ import annotations

import abc
import base64
import dataclasses
import shlex
import threading
import time
from pathlib import Path

from agent.link import (
    adapter_id,
    collect_android,
    cool_down,
    farm_key_bytes,
    parse_user_agent,
    parse_user_agent_os,
    provision_public_key,
)
from agent.protocol import FARM_KEY, AgentConfig, DeviceInfo, JobResult, JobSpec, ThermalReading
from engine.errors import BrowserError
from orchestrator.transports.base import (
    AgentExit,
    DeviceOffline,
    DeviceTimeout,
    InfraFailure,
    ProgressFn,
    ProtocolMismatch,
    Screenshot,
    SendReport,
    TransportError,
    emit,
)
from orchestrator.transports.hub import BrowserHub
from orchestrator.transports.hub import fresh_status as _fresh
from orchestrator.transports.local import LocalTransport

PAGE_PORT = 8790  # the phone's localhost port the page is served on (its origin: keep it fixed)
BROWSER_PACKAGE = "com.android.chrome"
PAGE_PATH = "/web/index.html"
DEVTOOLS_SOCKET = "chrome_devtools_remote"  # Chrome on Android's DevTools, an abstract unix socket
SCREENSHOT_ANSWER_S = 5.0  # for each DevTools answer, before the page is asked again
SCREENSHOT_WAIT_S = 40.0  # in all
# Errors of the page or the hub that are the infrastructure's, not the job's
LOST_KINDS = ("page-lost", "page-hidden", "timeout", "hub", "device-lost", "browser-exited")
# The files of a build the page keeps: what plans run (the rest is the host-side agent's)
PAGE_FILES = ("shaders/",)
PAGE_SUFFIXES = (".safetensors",)
# How long a page that was cut off from the hub (between two tasks, each with its forward) gets
# to come back through a new forward before it is opened again: it retries every second.
PAGE_RETURN_S = 5.0


class PageLink(abc.ABC):
    """How the farm reaches a device's page and the device's own readings."""

    @abc.abstractmethod
    def origin(self) -> str:
        """The hub's origin as the device sees it (http://localhost:8790, https://farm.lab:8443)."""

    @abc.abstractmethod
    def prepare(self, hub: BrowserHub) -> None:
        """Make the hub reachable from the device (a reverse forward)."""

    @abc.abstractmethod
    def open(self, url: str) -> None:
        """Have the device's browser open `url`."""

    def reenrol(self, url: str) -> None:
        """Enrol the device's page again with its enrolment `url`: its browser deleted the
        site's storage, token and farm key with it."""
        self.open(url)

    def gone(self) -> str | None:
        """Why waiting for the page is pointless (the browser exited), when the link can tell."""
        return None

    @abc.abstractmethod
    def device_info(self, adapter: dict, user_agent: str = "") -> DeviceInfo:
        """The device's model, OS, thermal zones and battery, with the page's adapter."""

    def thermal(self, phase: str) -> list[ThermalReading]:
        """The device's thermal readings now; none where the link cannot read them."""
        return []

    def screenshot(self) -> bytes:
        """The browser's page as a PNG, through Chromium's DevTools protocol."""
        raise TransportError(getattr(self, "name", "device"), "no screenshot: the farm has no DevTools reach "
                             "into this browser (screenshots are taken of phones over adb)")

    def close(self) -> None:  # noqa: B027
        pass


class AdbPageLink(PageLink):
    """An Android phone over ADB: `reverse:forward` of the phone's `page_port` to the hub, and
    `am start` of the page in `package` (Chrome by default)."""

    def __init__(self, adb, page_port: int = PAGE_PORT, package: str = BROWSER_PACKAGE):
        self.adb = adb
        self.page_port, self.package = page_port, package
        self._tunnel = None
        self._tunnel_port = None

    def origin(self) -> str:
        return f"http://localhost:{self.page_port}"

    def prepare(self, hub: BrowserHub) -> None:
        from orchestrator.transports.adb_reverse import ReverseTunnel

        if self._tunnel is None or self._tunnel_port != hub.port:
            if self._tunnel is not None:
                self._tunnel.close()
            self._tunnel = ReverseTunnel.for_transport(self.adb, self.page_port, hub.port)
            self._tunnel_port = hub.port
        self._tunnel.ensure()

    def open(self, url: str) -> None:
        for best_effort in ("input keyevent KEYCODE_WAKEUP", "svc power stayon usb"):
            self.adb.shell(best_effort)  # keep the screen on while it is plugged in, where allowed
        out, err, code = self.adb.shell(f"am start -a android.intent.action.VIEW -d {shlex.quote(url)} "
                                        f"{shlex.quote(self.package)}")
        text = (out + err).strip()
        if code != 0 or "Error" in text:
            raise TransportError(self.adb.name, f"could not open the page in {self.package}: {text[-300:]}")

    def device_info(self, adapter: dict, user_agent: str = "") -> DeviceInfo:
        def run(command: str) -> str:
            out, err, _ = self.adb.shell(command)
            return out + err

        serial = run("getprop ro.serialno").strip() or self.adb.name
        info = collect_android(run, adapter, serial)
        info.virtual = run("getprop ro.devicefarm.virtual").strip() == "1"
        return info

    def thermal(self, phase: str) -> list[ThermalReading]:
        try:
            info = self.device_info({})
        except TransportError:
            return []
        readings = [ThermalReading(phase, z.name, float(z.celsius)) for z in info.thermal]
        if info.battery is not None and info.battery.celsius is not None:
            readings.append(ThermalReading(phase, "battery", float(info.battery.celsius)))
        return readings

    def screenshot(self) -> bytes:
        """Chrome's DevTools on the phone's abstract socket `chrome_devtools_remote` (USB
        debugging opens it to ADB): the farm's page when it is open, else the first tab."""
        from orchestrator.transports.devtools import DevToolsError, capture_screenshot

        def channel():
            return self.adb.service_stream(f"localabstract:{DEVTOOLS_SOCKET}", "screenshot",
                                           refused=f"is {self.package} running? `farm devices discover` opens "
                                           "the farm's page in it")
        # A tab that is navigating to another process (the launch page opening the farm's) may
        # never answer the session opened on it: asked again, it has its new renderer.
        deadline = time.monotonic() + SCREENSHOT_WAIT_S
        while True:
            try:
                return capture_screenshot(channel, timeout_s=SCREENSHOT_ANSWER_S, prefer=PAGE_PATH)
            except DevToolsError as exc:
                raise ProtocolMismatch(self.adb.name, f"screenshot through DevTools: {exc}") from None
            except DeviceTimeout:
                if time.monotonic() > deadline:
                    raise

    def close(self) -> None:
        if self._tunnel is not None:
            self._tunnel.close()
            self._tunnel = None
        self.adb.close()


class WebPageLink(PageLink):
    """A device that opens the hub's HTTPS page itself (an iPhone's or iPad's Safari, any
    browser on the lab's network): the farm cannot open it, only wait for it. The browser tells
    what it runs on through its user agent; thermal zones and battery are not readable from a
    page, so the device's readings say `unknown` where a phone over ADB gives numbers."""

    def __init__(self, public_url: str, name: str):
        self.public_url, self.name = public_url.rstrip("/"), name

    def origin(self) -> str:
        return self.public_url

    def prepare(self, hub) -> None:
        pass

    def open(self, url: str) -> None:
        raise DeviceOffline(self.name, "the farm's page is not open on the device: open it there once "
                            f"(`farm devices enrol {self.name}` prints its URL and QR code) and keep it in front; a page "
                            "open there that says the farm does not know its token lost its enrolment (its browser "
                            "deleted the site's storage): open that URL again")

    def reenrol(self, url: str) -> None:
        raise DeviceOffline(self.name, f"{self.name}'s page is no longer enrolled: its browser deleted the site's "
                            "storage, token and farm key with it (Safari does after 7 days without a visit); open "
                            f"the URL `farm devices enrol {self.name}` prints on the device again and keep it in front")

    def device_info(self, adapter: dict, user_agent: str = "") -> DeviceInfo:
        os_name, os_version, model = parse_user_agent_os(user_agent)
        return DeviceInfo(serial=self.name, model=model, manufacturer="", os=os_name, os_version=os_version,
                          adapter=adapter, properties={"thermal": "unknown (a web page cannot read it)",
                                                       "battery": "unknown (a web page cannot read it)"})


def host_adapter_id() -> str:
    """The adapter group of this host's own device and virtual phones (agent.link)."""
    from engine.device import get_gpu

    return adapter_id(get_gpu().caps.as_dict())


_hub: BrowserHub | None = None
_hub_lock = threading.Lock()


def hub_record(settings) -> dict | None:
    """What the `farm hub` of this host wrote about itself (key, ports, public URL), or None."""
    import json

    try:
        return json.loads(settings.hub_file.read_text())
    except (OSError, ValueError):
        return None


def running_hub(settings):
    """The `farm hub` running on this host (orchestrator.transports.hub.HubClient), or None when
    none answers."""
    from engine.browser import BrowserError
    from orchestrator.transports.hub import HubClient

    record = hub_record(settings)
    if not record:
        return None
    client = HubClient(f"http://127.0.0.1:{record['port']}", record["key"], timeout_s=5.0)
    try:
        client.status("-")
    except BrowserError:
        return None
    return client


def public_url(settings) -> str:
    """The hub's HTTPS URL devices open: the running hub's word, else the settings'."""
    record = hub_record(settings) or {}
    return record.get("public_url") or settings.hub_public_url


def local_hub() -> BrowserHub:
    """This process's hub on 127.0.0.1 (what reverse forwards point at), started on first use."""
    global _hub
    with _hub_lock:
        if _hub is None:
            _hub = BrowserHub()
        return _hub


def enrolment_url(origin: str, serial: str, token: str, farm_pub: Path, virtual: bool = False) -> str:
    """The URL that enrols a device's page: the hub's page at `origin`, with the device's name,
    its token and the farm's public key (base64url) in the fragment, which no server sees;
    `virtual` marks a browser on the farm's own host (grouped with the host's adapter)."""
    key = base64.urlsafe_b64encode(farm_key_bytes(farm_pub)).decode().rstrip("=")
    return f"{origin}{PAGE_PATH}#device={serial}&token={token}&key={key}" + ("&virtual=1" if virtual else "")


def web_enrolment_url(settings, serial: str) -> str:
    """A web device's enrolment URL on this farm's hub (its token made on first use)."""
    from orchestrator.infra.keys import PUBLIC_KEY, ensure_farm_key
    from orchestrator.transports.hub import read_or_make_token

    ensure_farm_key(settings.config_dir)
    token = read_or_make_token(settings.browser_tokens_dir / serial)
    return enrolment_url(public_url(settings), serial, token, settings.config_dir / PUBLIC_KEY)


class BrowserTransport(LocalTransport):
    """Device `name` whose page `link` reaches, its host-side agent root `root`, its page's
    `token`. `farm_pub` is the farm's public key (PEM) the page is enrolled with."""

    def __init__(self, root: Path, link: PageLink, token: str, farm_pub: Path, *, name: str,
                 hub: BrowserHub | None = None, open_timeout_s: float = 90.0,
                 return_timeout_s: float = PAGE_RETURN_S, **kw):
        super().__init__(root, name=name, **kw)
        self.link, self.token = link, token
        self.farm_pub = Path(farm_pub)
        self.hub = hub
        self.open_timeout_s, self.return_timeout_s = open_timeout_s, return_timeout_s
        self._before: list[ThermalReading] = []
        self._cooldown: tuple[float, bool] | None = None
        self._notes: list[str] = []

    # ---- the page ------------------------------------------------------------------------------

    def enrolment_url(self) -> str:
        return enrolment_url(self.link.origin(), self.name, self.token, self.farm_pub)

    def ensure_page(self) -> BrowserHub:
        """The hub, with this device's page polling it: the link prepared and, when the page is
        not there, opened on the device."""
        hub = self.hub or local_hub()
        (self.root / "store").mkdir(parents=True, exist_ok=True)
        hub.register(self.name, self.token, self.root / "store")
        self.link.prepare(hub)
        # Each task's transport makes its own forward and ends it with the task: in between, the
        # page is cut off and retries every second, and its last word may be nearly PAGE_LOST_S
        # old, so hub.online() (a word within PAGE_LOST_S) is no proof it is there. A command
        # sent before it is back through this forward ended as page-lost within a second or
        # two (the demo's deploy of build B, after 1.4 s). Wait for a word through this forward;
        # only a page that does not come back is opened again (a relaunch loses its loaded plans).
        status = hub.status(self.name)
        if _fresh(status):
            return hub
        if status.get("seen_s_ago") is not None:  # it was here: a live page comes back by itself
            try:
                hub.wait_online(self.name, self.return_timeout_s, gone=self.link.gone)
                return hub
            except BrowserError:
                pass  # not back: open it again
        self.link.open(self.enrolment_url())
        try:
            hub.wait_online(self.name, self.open_timeout_s, gone=self.link.gone)
        except Exception as exc:  # noqa: BLE001  (BrowserError: the page never came)
            raise DeviceOffline(self.name, f"the page did not come up in the browser: {exc}") from None
        return hub

    def hello(self) -> dict:
        """The page's hello. A page that says it is not enrolled (its browser deleted the site's
        storage while it ran, and it held no copy) is enrolled again first: over ADB by opening its
        enrolment URL, a web device by the person the DeviceOffline names the command for."""
        hello = self._call("hello", timeout_s=60.0)
        if hello.get("key", True) and hello.get("device", self.name):
            return hello
        self.link.reenrol(self.enrolment_url())
        hub = self.hub or local_hub()
        try:
            hub.wait_online(self.name, self.open_timeout_s, gone=self.link.gone)
        except BrowserError as exc:
            raise DeviceOffline(self.name, f"the page did not come back after its enrolment URL was opened: {exc}") from None
        hello = self._call("hello", timeout_s=60.0)
        if not (hello.get("key", True) and hello.get("device", self.name)):
            raise DeviceOffline(self.name, "the page is still not enrolled after its enrolment URL was opened")
        return hello

    def _call(self, op: str, timeout_s: float = 120.0, *, again: bool = True, **fields) -> dict:
        from engine.browser import BrowserError

        hub = self.ensure_page()
        try:
            return hub.call(self.name, op, timeout_s=timeout_s, **fields)
        except BrowserError as exc:
            if exc.kind == "not-enrolled" and op != "hello" and again:
                self.hello()  # the page puts its enrolment back, or is enrolled again
                return self._call(op, timeout_s, again=False, **fields)
            if exc.kind in LOST_KINDS:
                raise DeviceOffline(self.name, f"{op}: {exc}") from None
            raise TransportError(self.name, f"{op}: {exc}") from None

    # ---- the Transport interface -----------------------------------------------------------------

    def info(self) -> DeviceInfo:
        from engine.browser import caps_of

        hello = self.hello()
        user_agent = hello["adapter"].get("user_agent", "")
        adapter = caps_of(hello["adapter"]).as_dict()
        info = self.link.device_info(adapter, user_agent)
        browser = parse_user_agent(user_agent)
        info.properties.update({"engine_host": "browser", "browser": browser.get("name", "unknown"),
                                "browser_version": browser.get("version", "unknown"), "user_agent": user_agent,
                                "page_secure_context": str(hello.get("secure"))})
        info.agent_version = f"page@{hello.get('current') or 'none'}"
        info.virtual = info.virtual or bool(hello.get("virtual"))
        # A phone's GPU is its own; a virtual device's page runs on this host, beside the host's
        # own adapter and the other virtual devices: one group, so none is timed beside another.
        info.adapter_id = host_adapter_id() if info.virtual else adapter_id(adapter, machine=f"browser:{self.name}")
        return info

    def send_bundle(self, bundle_dir: Path, progress: ProgressFn | None = None, *,
                    allow_downgrade: bool = False) -> SendReport:
        """The host-side install (the agent verifies the build), then the page's: it verifies the
        signature itself and fetches only the files it does not hold. What was sent is what the
        page fetched."""
        (self.root / FARM_KEY).parent.mkdir(parents=True, exist_ok=True)
        if not (self.root / FARM_KEY).is_file():
            provision_public_key(self.root, self.farm_pub)
        host = super().send_bundle(bundle_dir, progress, allow_downgrade=allow_downgrade)
        manifest_bytes, manifest = self.read_manifest(Path(bundle_dir))
        wanted = [f.path for f in manifest.files if f.path.startswith(PAGE_FILES) or f.path.endswith(PAGE_SUFFIXES)]
        emit(progress, {"event": "page_deploy", "build": manifest.build, "files": len(wanted)})
        signature = (Path(bundle_dir) / "manifest.sig").read_bytes()
        report = self._call("deploy", timeout_s=max(600.0, self.timeout_s), build=manifest.build,
                            manifest_b64=base64.b64encode(manifest.canonical_bytes()).decode(),
                            signature_b64=base64.b64encode(signature).decode(), files=wanted)
        # A page older than chunked deploys reports none of the chunk, freed and storage fields.
        emit(progress, {"event": "bundle_installed" if report["fetched_files"] else "bundle_current",
                        "build": manifest.build, "where": "page", "bytes": report["fetched_bytes"],
                        "chunks": report.get("fetched_chunks", 0), "chunk_size": report.get("chunk_size", 0),
                        "freed_bytes": report.get("freed_bytes", 0), "kept_builds": report.get("kept_builds", []),
                        "persisted": report.get("persisted"), "quota_bytes": report.get("quota_bytes"),
                        "usage_bytes": report.get("usage_bytes")})
        return SendReport(report["fetched_bytes"], report["fetched_files"], report["held_files"] +
                          len(manifest.files) - len(wanted), host.seconds, manifest.build,
                          host.installed or report["fetched_files"] > 0, host.kept_current)

    def exec_job(self, spec: JobSpec, limit_s: float, on_line, progress: ProgressFn | None) -> AgentExit:
        hub = self.ensure_page()
        if spec.executor != "browser":  # the farm sets it when the job is submitted
            raise ProtocolMismatch(self.name, f"job {spec.job_id} asks for the {spec.executor} executor; "
                                   "this device's engine is its browser's page")
        self.configure_agent(AgentConfig(browser_page=hub.control_url(self.name)))  # where the page is
        self._cooldown, self._notes = None, []
        if spec.cooldown is not None:  # on the device's own zones: the host's are not the device's
            self._cooldown = cool_down(spec.cooldown, self._hottest, self._notes.append,
                                       lambda event: emit(progress, event))
        self._before = self.link.thermal("before")
        return super().exec_job(dataclasses.replace(spec, cooldown=None), limit_s,
                                on_line, progress)

    def _hottest(self) -> float | None:
        readings = self.link.thermal("before")
        return max((r.celsius for r in readings), default=None)

    def finish_result(self, spec: JobSpec, result: JobResult) -> JobResult:
        error = result.error or ""
        if result.status == "failed" and any(error.startswith(f"browser: {k}:") for k in LOST_KINDS):
            raise InfraFailure(self.name, f"job {spec.job_id}: {error}", result.log_tail)
        result.thermal = [*self._before, *result.thermal, *self.link.thermal("after")]
        if self._cooldown is not None:
            result.cooldown_wait_s, result.cooldown_timed_out = self._cooldown
            result.log_tail = "".join(f"[farm] {note}\n" for note in self._notes) + result.log_tail
        if result.environment is not None and not result.environment.os:
            try:
                device = self.link.device_info({})
            except TransportError:
                device = None
            if device is not None:
                env = result.environment
                env.os, env.os_version = device.os, device.os_version
                env.os_build = device.properties.get("ro.build.fingerprint", "")
        return result

    def screenshot(self) -> Screenshot:
        """The device's page, as its browser shows it (the link's DevTools)."""
        return self.checked_png(self.link.screenshot(), "devtools", "the page's DevTools")

    def close(self) -> None:
        self.link.close()
