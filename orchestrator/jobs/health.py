"""Device health (docs/devices.md): the probe that asks a device what it is and records the
answer through the state machine (orchestrator/store/device_states.py); the heartbeat of each
host, which every worker keeps for the hosts whose queues it consumes; the health check that
beat runs every `health_check_every_s`, which takes the devices of a host not heard from for
`stale_after_s` offline, sends a probe of every offline or unauthorized device that is due to
the worker of its host (once that host is heard again), each failure doubling the wait before
the next (PROBE_BACKOFF_S), and frees busy devices whose holder vanished; and the scan of what
the ADB transport can see (USB, and known or given TCP addresses) behind `farm devices scan`. The
third job in a row that ends infra_failed quarantines its device; the job path counts that
(store.count_job_outcome). No transaction is open while a device is asked."""

from __future__ import annotations

import datetime as dt
import logging
import shlex
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from celery import Celery
from celery.signals import worker_ready, worker_shutdown

from agent.protocol import DeviceInfo
from orchestrator import store
from orchestrator.infra import inputs
from orchestrator.infra.settings import Settings
from orchestrator.jobs.celery_app import host_queue, session_for, settings_of
from orchestrator.store import Session, make_session_factory
from orchestrator.store.device_states import PROBED_STATES, DeviceEvent
from orchestrator.store.models import Device, DeviceState, TransportKind, utcnow
from orchestrator.store.session import make_unpooled_engine
from orchestrator.transports import TransportError
from orchestrator.transports.factory import make_transport

log = logging.getLogger(__name__)

PROBE_BACKOFF_S = (30.0, 1800.0)  # the wait after a device's first failed probe, and the longest
PROBE_DEVICE = "orchestrator.tasks.probe_device"
HOST_BEAT_MAX_S = 5.0  # a worker stamps its hosts at least this often (a third of stale_after_s when shorter)

Sessions = Callable[[], Session]


def backoff_s(failures: int) -> float:
    """How long to wait before probing again a device that failed `failures` probes in a row:
    30 s, doubling with each failure, at most 30 min."""
    first, longest = PROBE_BACKOFF_S
    return min(longest, first * 2 ** min(max(failures - 1, 0), 32))


# ---- the probe ----------------------------------------------------------------------------


def stored_input_error(device: Device) -> str | None:
    """Why this device's stored serial or address cannot be used (None when both can): what an
    older farm or a hand-edited database may hold. The message names the fix."""
    try:
        inputs.check_serial(device.serial)
    except inputs.BadInput as exc:
        return (f"device {device.serial!r}: {exc}; remove it (`farm devices remove {shlex.quote(device.serial)}`) "
                "and add it again under a plain name")
    try:
        inputs.parse_device_address(device.transport, device.address)
    except inputs.BadInput as exc:
        return (f"device {device.serial!r}: its stored address cannot be used: {exc}; fix it with "
                f"`farm devices set-address {device.serial} ADDRESS`")
    return None


def ask(settings: Settings, device: Device) -> tuple[DeviceInfo | None, TransportError | None]:
    """What the device says it is, or why it said nothing. `device` need not be stored."""
    try:
        with make_transport(device, settings) as transport:
            return transport.info(), None
    except TransportError as exc:
        return None, exc
    except OSError as exc:  # a missing token file
        return None, TransportError(device.serial, f"{exc.__class__.__name__}: {exc}")


# What a transport's error says about the device: it answered (busy, incompatible, ...), it
# refused this host, or nobody answered.
_EVENT_OF_STATE = {DeviceState.available: DeviceEvent.answered, DeviceState.busy: DeviceEvent.answered,
                   DeviceState.unauthorized: DeviceEvent.refused}


def observed(error: TransportError) -> DeviceEvent:
    return _EVENT_OF_STATE.get(store.TRANSPORT_STATES.get(str(error.state)), DeviceEvent.unreachable)


def record_probe(session: Session, device_id: int, info: DeviceInfo | None, error: TransportError | None,
                 now: dt.datetime, host: str) -> Device:
    """Record a probe's answer (flushes only): the device's identity and `host` when it
    answered, the event its answer means, and the back-off: a device left offline or
    unauthorized is due again after backoff_s(its failures in a row); one that answered is not
    due at all. A busy device's state is its holder's to record (the outcome of its job or
    deployment), not a probe's."""
    device = store.get_device(session, device_id)
    if info is not None:
        store.upsert_device(session, device.serial, device.transport, info=info, host=host)
        event, reason = DeviceEvent.answered, ""
    else:
        assert error is not None
        event, reason = observed(error), error.detail
    if device.state == DeviceState.busy:
        return device
    store.apply_device_event(session, device.id, event, reason)
    if device.state in PROBED_STATES:
        device.probe_failures += 1
        device.next_probe_at = now + dt.timedelta(seconds=backoff_s(device.probe_failures))
    elif event == DeviceEvent.answered:
        device.probe_failures, device.next_probe_at = 0, None
    session.flush()
    return device


@dataclass
class Probe:
    device_id: int
    serial: str
    state: DeviceState  # as recorded
    error: TransportError | None
    address_error: str | None  # the stored serial or address cannot be used (it was not asked)


def probe(settings: Settings, sessions: Sessions, device: Device, now: dt.datetime | None = None) -> Probe:
    """Ask one device what it is through its transport, then record the answer in one short
    transaction (record_probe). A device whose stored serial or address cannot be used is not
    asked; it is recorded unreachable with the fix as its reason. What `farm devices discover`
    and the health check both do."""
    address_error = stored_input_error(device)
    if address_error is not None:
        info, error = None, TransportError(device.serial, address_error)
    else:
        info, error = ask(settings, device)
    with sessions() as session, session.begin():
        row = record_probe(session, device.id, info, error, now or utcnow(), settings.host_name)
        return Probe(row.id, row.serial, row.state, error, address_error)


# ---- hosts: heard while their workers run -------------------------------------------------


def host_beat_s(settings: Settings) -> float:
    """How often a worker stamps its hosts as heard: a third of stale_after_s, after which a
    silent host's devices go offline, and at most HOST_BEAT_MAX_S."""
    return min(HOST_BEAT_MAX_S, settings.stale_after_s / 3)


class HostHeartbeat:
    """A thread that, while a worker runs, stamps the hosts whose queues it consumes (host.<name>)
    as heard (hosts.last_seen) every host_beat_s, each time over a connection of its own that
    gives up after one beat's time: the worker's main process forks its pool (no connection may
    be left for a child to inherit), and a host cut off from the database must not hang here. A
    missed beat is logged; the next one may land."""

    def __init__(self, settings: Settings, hosts: list[str]):
        self.settings, self.hosts, self.every_s = settings, hosts, host_beat_s(settings)
        self._engine = make_unpooled_engine(settings.database_url, self.every_s)
        self._sessions = make_session_factory(self._engine)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="host-heartbeat", daemon=True)

    def beat(self) -> None:
        with self._sessions() as session, session.begin():
            for host in self.hosts:
                store.get_or_create_host(session, host)

    def _loop(self) -> None:
        while True:
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001  (the store is out of reach: the next beat may land)
                log.warning("could not stamp host(s) %s as heard: %s", ", ".join(self.hosts), str(exc).splitlines()[0])
            if self._stop.wait(self.every_s):
                return

    def start(self) -> HostHeartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every_s + 5)
        self._engine.dispose()


_heartbeats: list[HostHeartbeat] = []


@worker_ready.connect
def _start_host_heartbeat(sender, **_) -> None:
    """A farm worker that consumes host queues keeps those hosts heard while it runs."""
    settings = getattr(sender.app, "farm_settings", None)
    prefix = host_queue("")
    hosts = sorted(name[len(prefix):] for name in sender.app.amqp.queues.consume_from if name.startswith(prefix))
    if settings is not None and hosts:
        _heartbeats.append(HostHeartbeat(settings, hosts).start())


@worker_shutdown.connect
def _stop_host_heartbeat(**_) -> None:
    while _heartbeats:
        _heartbeats.pop().stop()


# ---- the health check ---------------------------------------------------------------------


def check(app: Celery, now: dt.datetime | None = None) -> dict[str, list[int]]:
    """Beat's health check. In one transaction: busy devices whose lease ran out are available
    again (lease_expired); the devices of every host not heard from for `stale_after_s` go
    offline (no worker there drives them); and every due device's next probe is pushed back by
    the back-off it would get on failing (so a probe that never reports is sent again then, not
    at every check), except on a host not heard from, whose devices stay due until it is heard
    again. After the commit, a probe of each due device goes to the queue of its host (a USB
    phone is reachable only there), expiring after one check interval. Returns the ids of the
    devices freed, taken offline with their host, and probed."""
    settings, now = settings_of(app), now or utcnow()
    heard_since = now - dt.timedelta(seconds=settings.stale_after_s)
    with session_for(app) as session, session.begin():
        freed = store.expire_device_leases(session, now)
        offline = store.take_silent_hosts_offline(session, heard_since, now)
        sends = []
        for device in store.devices_due_for_probe(session, now, heard_since):
            device.next_probe_at = now + dt.timedelta(seconds=backoff_s(device.probe_failures + 1))
            sends.append((device.id, host_queue(device.host.name if device.host is not None else settings.host_name)))
    for device_id, queue in sends:
        try:
            app.signature(PROBE_DEVICE, args=(device_id,)).apply_async(
                queue=queue, ignore_result=True, expires=settings.health_check_every_s)
        except Exception as exc:  # noqa: BLE001  (the broker is down: the device is due again after its back-off)
            log.warning("could not send the probe of device %s (%s)", device_id, exc)
    if offline:
        log.warning("health check: devices %s offline: their host is silent", offline)
    if freed or sends:
        log.info("health check: freed %s, probing %s", freed, [device_id for device_id, _ in sends])
    return {"freed": freed, "offline": offline, "probed": [device_id for device_id, _ in sends]}


def probe_device(app: Celery, device_id: int, now: dt.datetime | None = None) -> str:
    """The health check's probe of one device, on its host's worker: "skipped" when it is no
    longer offline or unauthorized (a job reached it meanwhile, an operator quarantined it) or
    something holds it; else the state it was left in."""
    now = now or utcnow()
    with session_for(app) as session:
        try:
            device = store.get_device(session, device_id)
        except store.StoreError:
            return "skipped"
        if device.state not in PROBED_STATES or (
                device.lease_holder is not None and device.lease_until is not None and device.lease_until >= now):
            return "skipped"
    return str(probe(settings_of(app), partial(session_for, app), device, now).state)


# ---- what the ADB transport can see ------------------------------------------------------


def usb_serials() -> tuple[list[str], str | None]:
    """The serials of the ADB devices plugged in over USB, and why USB was not looked at (None
    when it was)."""
    try:
        from adb_shell.transport.usb_transport import UsbTransport
    except ImportError:  # adb-shell without its usb extra (libusb1)
        return [], "USB not scanned: adb-shell's usb extra is not installed (pip install 'adb-shell[usb]')"
    try:
        return sorted(str(t.serial_number) for t in UsbTransport.find_all_adb_devices()), None
    except Exception as exc:  # noqa: BLE001  (no libusb, no permission on /dev/bus/usb: say so, scan TCP)
        return [], f"USB not scanned: {exc.__class__.__name__}: {exc}"


@dataclass
class Seen:
    """One ADB address that was scanned, and what answered there."""

    address: str  # usb:SERIAL or HOST:PORT
    source: str  # usb, registered (a known device's address) or given (--address)
    state: DeviceState  # what the probe found: available, offline or unauthorized
    serial: str = ""  # what the device calls itself, when it said; the USB serial; else ""
    model: str = ""
    gpu: str = ""
    error: str | None = None
    registered_as: str | None = None  # the serial the farm knows it by (same serial or same address)
    note: str = ""  # why it cannot be registered
    info: DeviceInfo | None = field(default=None, repr=False)

    @property
    def registrable(self) -> bool:
        return self.registered_as is None and not self.note and self.state != DeviceState.offline

    def as_dict(self) -> dict[str, Any]:
        return {"address": self.address, "source": self.source, "serial": self.serial or None,
                "model": self.model, "gpu": self.gpu, "state": str(self.state), "error": self.error,
                "registered_as": self.registered_as, "registrable": self.registrable, "note": self.note or None}


_SCANNED_STATE = {DeviceEvent.answered: DeviceState.available, DeviceEvent.refused: DeviceState.unauthorized}


def scan(settings: Settings, sessions: Sessions, addresses: list[str], *, usb: bool = True
         ) -> tuple[list[Seen], str | None]:
    """Probe every address the ADB transport can reach: the USB devices plugged into this
    host, the TCP addresses of the adb devices already registered, and `addresses` (HOST:PORT,
    canonical). Nothing is recorded. Returns what answered at each, and why USB was not looked
    at (None when it was, or `usb` is False)."""
    with sessions() as session:
        known = store.devices_of_transport(session, TransportKind.adb)
        serials_known = {d.serial for d in known}
        by_address = {d.address: d.serial for d in known if d.address}
    usb_found, usb_note = usb_serials() if usb else ([], None)
    candidates = {f"usb:{serial}": "usb" for serial in usb_found}
    for device in known:
        try:
            if isinstance(inputs.parse_device_address("adb", device.address), inputs.AdbTcpAddress):
                candidates.setdefault(device.address, "registered")
        except inputs.BadInput:
            continue  # `farm devices discover` names it with its fix
    for address in addresses:
        candidates.setdefault(address, "given")

    seen, claimed = [], set(serials_known)
    for address, source in candidates.items():
        info, error = ask(settings, Device(serial=address, transport=TransportKind.adb, address=address))
        event = DeviceEvent.answered if info is not None else observed(error)
        state = _SCANNED_STATE.get(event, DeviceState.offline)
        entry = Seen(address, source, state, error=None if error is None else str(error), info=info)
        if info is not None:
            entry.serial, entry.model = info.serial, info.model
            entry.gpu = str((info.adapter or {}).get("device") or "")
        elif state != DeviceState.offline:
            # Something answered without saying what it is (it refuses this host, its agent
            # is too old): its USB serial, or the HOST:PORT adb itself names a network device by.
            entry.serial = address.removeprefix("usb:")
        entry.registered_as = entry.serial if entry.serial in serials_known else by_address.get(address)
        if entry.registered_as is None and state != DeviceState.offline:
            try:
                inputs.check_serial(entry.serial)
            except inputs.BadInput as exc:
                entry.note = f"cannot be registered: {exc}"
            else:
                if entry.serial in claimed:
                    entry.note = f"the same device as another address ({entry.serial})"
                claimed.add(entry.serial)
        seen.append(entry)
    return seen, usb_note


def register(settings: Settings, sessions: Sessions, seen: list[Seen]) -> list[str]:
    """Register every registrable scanned device on this host, in one transaction: a device that
    answered is recorded with its identity, available; one that refused this host is recorded
    unauthorized, and the health check probes it until someone accepts the key on the phone.
    Returns the serials registered."""
    done = []
    with sessions() as session, session.begin():
        for entry in seen:
            if not entry.registrable:
                continue
            device = store.upsert_device(session, entry.serial, TransportKind.adb, entry.address, info=entry.info,
                                         host=settings.host_name)
            event = DeviceEvent.answered if entry.state == DeviceState.available else DeviceEvent.refused
            store.apply_device_event(session, device.id, event, entry.error or "")
            done.append(entry.serial)
    return done
