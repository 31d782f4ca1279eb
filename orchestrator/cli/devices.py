"""`farm devices ...`: the fleet as the store knows it: add, list, show, remove, quarantine and
release devices; `discover`, which asks every known device what it is through its transport
and records the answer (GPU identity, state, last seen); and `scan`, which lists what the ADB
transport can see (USB, known and given TCP addresses) and offers to register it. Probing and
scanning live in orchestrator/jobs/health.py. Also owns `open_store`, the one way a CLI command
reaches the database: settings read here, schema checked at head."""

from __future__ import annotations

import datetime as dt
import re
import sys
from contextlib import nullcontext
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from orchestrator.infra import inputs
from orchestrator.store.models import Device, DeviceState, TransportKind

from . import completion, validate
from .common import (
    BAD_INPUT,
    JSON_OPTION,
    cli_settings,
    could_not_run,
    current_user,
    fail,
    get_or_fail,
    iso,
    open_store,
    print_json,
)
from .output import Table, Text, console, styled

app = typer.Typer(help="Manage the devices of the farm.", no_args_is_help=True)


# ---- presentation -------------------------------------------------------------------------


def device_dict(device: Device, reservation=None) -> dict[str, Any]:
    """A device as the CLI prints it; `reservation`: the one holding it now (store.active_reservation)."""
    return {
        "id": device.id,
        "serial": device.serial,
        "transport": str(device.transport),
        "engine_host": device.engine_host,
        "address": device.address,
        "host": device.host.name if device.host is not None else None,
        "state": str(device.state),
        "state_reason": device.state_reason,
        "last_seen": iso(device.last_seen),
        "model": device.model,
        "manufacturer": device.manufacturer,
        "os": device.os,
        "os_version": device.os_version,
        "virtual": device.virtual,
        "gpu": {
            "vendor": device.gpu_vendor,
            "architecture": device.gpu_architecture,
            "device": device.gpu_device,
            "driver": device.gpu_driver,
            "backend": device.gpu_backend,
        },
        "lease_holder": device.lease_holder,
        "lease_until": iso(device.lease_until),
        "reserved_by": reservation.holder if reservation is not None else None,
        "reserved_until": iso(reservation.until) if reservation is not None else None,
        "reservation_note": reservation.note if reservation is not None else None,
        "created_at": iso(device.created_at),
    }


_STATE_STYLE = {"available": "green", "busy": "yellow", "offline": "red", "unauthorized": "red",
                "quarantined": "magenta"}


def _state(device: Device) -> Text:
    state = str(device.state)
    return styled(state, _STATE_STYLE.get(state, "white"))


def _held(reservation) -> str:
    """A listing's reserved cell: "ana until 14:00 UTC", or "-"."""
    return "-" if reservation is None else f"{reservation.holder} until {_utc(iso(reservation.until))}"


# ---- commands -----------------------------------------------------------------------------


class EngineHost(StrEnum):
    python = "python"
    browser = "browser"


ADDRESS_HELP = ("local: agent root folder (default <data_dir>/devices/SERIAL); adb: HOST:PORT or usb:SERIAL; "
                "http: the agent's http(s) URL (token in <config_dir>/tokens/SERIAL); web: none.")


@app.command()
def add(
    serial: str = typer.Argument(..., help="The device's unique name (adb serial, host name, ...).",
                                 callback=validate.serial),
    # Eager: parsed before --address, wherever it stands, so the address is checked against it.
    transport: TransportKind = typer.Option(..., "--transport", help="How the farm reaches it.", is_eager=True),
    address: str = typer.Option("", "--address", help=ADDRESS_HELP, callback=validate.device_address),
    engine_host: EngineHost = typer.Option(EngineHost.python, "--engine-host",
                                           help="python: farm-agent runs the engine on the device; browser: the "
                                           "device's web browser does (an Android phone's Chrome over adb: README, "
                                           "Connect an Android phone)."),
):
    """Register a device; it stays offline until `farm devices discover` reaches it."""
    from orchestrator import store

    if transport is TransportKind.web:
        engine_host = EngineHost.browser  # a web device is its browser
    if engine_host is EngineHost.browser and transport not in (TransportKind.adb, TransportKind.web):
        fail(f"a device whose engine runs in its browser is reached over adb (a phone's Chrome through a reverse forward) or web (a "
             f"browser that opens the farm's hub over HTTPS), not {transport}")
    settings = cli_settings()
    with open_store(settings) as sessions, sessions() as session:
        if store.find_device(session, serial) is not None:
            fail(f"device {serial!r} already exists; `farm devices remove {serial}` first to re-add it")
        device = store.upsert_device(session, serial, transport, address, host=settings.host_name,
                                     engine_host=engine_host.value)
        session.commit()
        console.print(f"added device {device.serial} ({device.transport}, engine on {device.engine_host}, "
                      f"{device.address or 'default address'})", highlight=False, markup=False)
    if transport is TransportKind.web:
        _print_enrolment(settings, serial)


def _print_enrolment(settings, serial: str) -> None:
    from orchestrator.infra.ca import default_dir, fingerprint, load_ca_cert
    from orchestrator.infra.qr import qr_text
    from orchestrator.transports.browser import web_enrolment_url

    url = web_enrolment_url(settings, serial)
    console.print(f"open this once on {serial} (it holds the device's token: share it with no one else):",
                  highlight=False)
    typer.echo(url)
    typer.echo(qr_text(url))
    try:
        ca = load_ca_cert(default_dir(settings.config_dir))
        console.print(f"the device must trust the farm's CA first (fingerprint {fingerprint(ca)}): `farm ca export "
                      "farm-ca.mobileconfig` for iPhones and iPads, farm-ca.cer for Android; README, Connect an iPhone",
                      highlight=False)
    except Exception:  # noqa: BLE001  (no CA yet: `farm hub` makes it)
        console.print("the farm's CA does not exist yet: `farm hub` makes it (or `farm ca init`); then install it "
                      "on the device (`farm ca export`)", highlight=False)


@app.command()
def enrol(serial: str = typer.Argument(..., help="A web device (`farm devices add SERIAL --transport web`).")):
    """Print the URL (and QR code) a web device opens once to join the farm."""
    from orchestrator import store

    settings = cli_settings()
    with open_store(settings) as sessions, sessions() as session:
        device = store.find_device(session, serial)
    if device is None:
        fail(f"no device {serial!r}")
    if device.transport is not TransportKind.web:
        fail(f"{serial} is reached over {device.transport}: the farm opens its page itself")
    _print_enrolment(settings, serial)


@app.command("list")
def list_devices(as_json: bool = JSON_OPTION):
    """List the devices with their state, GPU and who has reserved them."""
    from orchestrator import store
    from orchestrator.store import queries

    with open_store(cli_settings()) as sessions, sessions() as session:
        devices = queries.list_devices(session)
        held = store.active_reservations(session)
        if as_json:
            print_json([device_dict(d, held.get(d.id)) for d in devices])
            return
        if not devices:
            console.print("no devices; add one with `farm devices add SERIAL --transport ... --address ...`")
            return
        table = Table("serial", "transport", "engine", "state", "gpu", "model", "last seen", "reserved",
                      drop_first=("engine", "last seen", "transport", "model"), keep=("state",))
        for d in devices:
            gpu = d.gpu_device or d.gpu_vendor or "-"
            table.add_row(d.serial, str(d.transport), d.engine_host, _state(d), gpu, d.model or "-",
                          d.last_seen.strftime("%Y-%m-%d %H:%M:%S") if d.last_seen else "never",
                          _held(held.get(d.id)))
        console.print(table)


@app.command()
def show(serial: str = typer.Argument(..., help="Device serial.", autocompletion=completion.devices),
         as_json: bool = JSON_OPTION):
    """Show one device: identity, GPU, health, lease and who has reserved it."""
    from orchestrator import store

    with open_store(cli_settings()) as sessions, sessions() as session:
        device = get_or_fail(store.get_device, session, serial)
        data = device_dict(device, store.active_reservation(session, device.id))
        if as_json:
            print_json(data)
            return
        table = Table(show_header=False, box=None)
        for key, value in data.items():
            if key == "gpu":
                for gk, gv in value.items():
                    table.add_row(f"gpu {gk}", gv or "-")
            elif key == "state":
                table.add_row(key, _state(device))
            else:
                table.add_row(key, "-" if value in (None, "") else str(value))
        console.print(table)


@app.command()
def remove(
    serial: str = typer.Argument(..., help="Device serial.", autocompletion=completion.devices),
    force: bool = typer.Option(False, "--force", help="Also delete its jobs, deployments and results."),
):
    """Forget a device. Refused while it has jobs or results, unless --force."""
    from orchestrator import store

    with open_store(cli_settings()) as sessions, sessions() as session:
        try:
            device = store.get_device(session, serial)
        except store.StoreError as exc:
            fail(str(exc))
        history = store.device_history(session, device.id)
        if history and not force:
            fail(f"device {serial!r} has {history} jobs, runs or deployments; "
                 "`farm devices quarantine` it, or pass --force to delete them too")
        store.remove_device(session, device)
        session.commit()
    from orchestrator.services.screenshots import forget_device_screenshots

    forget_device_screenshots(cli_settings(), serial)  # its rows went with the device
    revoked = _revoke(serial)
    console.print(f"removed device {serial}" + (" and revoked its page token" if revoked else ""), highlight=False)


def _revoke(serial: str) -> bool:
    """Revoke a device's page token (the hub refuses it from its next request on)."""
    from orchestrator.transports.hub import revoke_token

    return revoke_token(cli_settings().browser_tokens_dir / serial)


@app.command()
def quarantine(
    serial: str = typer.Argument(..., help="Device serial.", autocompletion=completion.devices),
    reason: str = typer.Option(..., "--reason", help="Why (shown in listings)."),
):
    """Take a device out of service until `farm devices release`; discovery will not bring it back.
    A browser device's page token is revoked: after the release, open its new enrolment URL
    (`farm devices enrol`)."""
    _set_state(serial, DeviceState.quarantined, reason)
    if _revoke(serial):
        console.print(f"revoked {serial}'s page token: after `farm devices release {serial}`, open "
                      f"`farm devices enrol {serial}`'s new URL on it", highlight=False, markup=False)


@app.command("revoke-token")
def revoke_token_command(serial: str = typer.Argument(..., help="Device serial.", callback=validate.serial,
                                                      autocompletion=completion.devices)):
    """Revoke a browser device's page token at once (a lost or shared phone): the hub refuses
    it from its next request on; `farm devices enrol SERIAL` prints a new one."""
    if not _revoke(serial):
        fail(f"{serial} has no page token (only browser devices have one)")
    console.print(f"revoked {serial}'s page token; `farm devices enrol {serial}` prints the URL of a new one",
                  highlight=False, markup=False)


@app.command()
def release(
    serial: str = typer.Argument(..., help="Device serial.", autocompletion=completion.devices),
    reservation: bool | None = typer.Option(None, "--reservation/--quarantine", show_default=False,
                             help="Which hold to end (default: the reservation when one holds the device, "
                             "else the quarantine)."),
):
    """End a hold on a device: its reservation (`farm devices reserve`) when one is active, else
    its quarantine (back in service, available until a probe says otherwise). --reservation or
    --quarantine picks one, and must when the device has both; the command says which it ended."""
    from orchestrator import store

    if reservation is None:
        with open_store(cli_settings()) as sessions, sessions() as session:
            device = get_or_fail(store.get_device, session, serial)
            held = store.active_reservation(session, device.id)
            if held is not None and device.state == DeviceState.quarantined:
                fail(f"{serial} is both reserved by {held.holder} and quarantined; say which hold to end: "
                     f"`farm devices release {serial} --reservation` or `--quarantine`")
            reservation = held is not None
    if reservation:
        _unreserve(serial)
    else:
        _set_state(serial, DeviceState.available, "released by operator")


def _unreserve(serial: str) -> None:
    from orchestrator import store

    with open_store(cli_settings()) as sessions, sessions() as session:
        device = get_or_fail(store.get_device, session, serial)
        ended = store.release_reservation(session, device)
        if ended is None:
            fail(f"{serial} is not reserved (`farm devices reservations` lists who holds what)")
        session.commit()
        console.print(f"released {ended.holder}'s reservation of {serial}; schedules and checks use it again",
                      highlight=False, markup=False)


# ---- reservations: a person holds a device (orchestrator/store/reservations.py) -----------------

_DURATION = re.compile(r"(\d+)([mhd])")
_UNIT_S = {"m": 60, "h": 3600, "d": 86400}
MAX_RESERVATION = dt.timedelta(days=30)


def parse_duration(value: str) -> dt.timedelta:
    """30m, 2h, 1d, 1h30m: how long a reservation lasts (at most 30 days)."""
    text = (value or "").strip().lower()
    parts = _DURATION.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise typer.BadParameter(f"{value!r} is not a duration: write it as 30m, 2h, 1d or 1h30m")
    length = dt.timedelta(seconds=sum(int(n) * _UNIT_S[u] for n, u in parts))
    if length <= dt.timedelta(0) or length > MAX_RESERVATION:
        raise typer.BadParameter(f"{value!r}: a reservation lasts more than 0 and at most 30 days (1d ... 30d)")
    return length


def reservation_dict(reservation, serial: str) -> dict[str, Any]:
    return {"device": serial, "holder": reservation.holder, "note": reservation.note,
            "starts_at": iso(reservation.starts_at), "until": iso(reservation.until),
            "released_at": iso(reservation.released_at)}


@app.command()
def reserve(
    serial: str = typer.Argument(..., help="Device serial.", autocompletion=completion.devices),
    length: str = typer.Option(..., "--for", metavar="DURATION", help="How long: 30m, 2h, 1d, 1h30m (at most 30d)."),
    note: str = typer.Option("", "--note", help="Why (shown to whoever the reservation turns away)."),
    holder: str = typer.Option(None, "--as", metavar="NAME", help="Who holds it (default: $USER)."),
    as_json: bool = JSON_OPTION,
):
    """Book a device: until the reservation ends, nightly schedules skip it (their batch says
    so) and checks and jobs that name it are refused with the holder's name. Jobs queued before
    stay queued (`farm jobs cancel` them). Reserving a device you already hold extends it; one
    held by someone else is refused. `farm devices release SERIAL` ends it early."""
    from orchestrator import store

    duration = parse_duration(length)
    holder = (holder if holder is not None else current_user()).strip()
    if not holder:
        fail("who holds it? $USER is not set: pass --as NAME")
    with open_store(cli_settings()) as sessions, sessions() as session:
        device = get_or_fail(store.get_device, session, serial)
        now = store.utcnow()
        try:
            reservation, extended = store.reserve_device(session, device, holder, now + duration, note, now=now)
        except store.StoreError as exc:
            fail(str(exc))
        session.commit()
        data = reservation_dict(reservation, device.serial)
    if as_json:
        print_json(data | {"extended": extended})
        return
    verb = "extended: " if extended else ""
    console.print(f"{verb}{store.reservation_line(serial, reservation)}; `farm devices release {serial}` ends it "
                  "early", highlight=False, markup=False)


@app.command("reservations")
def list_reservations_command(
    ended: bool = typer.Option(False, "--all", help="Also those that ended in the last day."),
    as_json: bool = JSON_OPTION,
):
    """Who holds which device, until when and why."""
    from orchestrator import store

    with open_store(cli_settings()) as sessions, sessions() as session:
        rows = [reservation_dict(r, serial) for r, serial in store.list_reservations(session, include_ended=ended)]
    if as_json:
        print_json(rows)
        return
    if not rows:
        console.print("no device is reserved; `farm devices reserve SERIAL --for 2h` books one", highlight=False)
        return
    table = Table("device", "holder", "until", "note", "ended")
    for r in rows:
        table.add_row(r["device"], r["holder"], _utc(r["until"]), r["note"] or "-", _utc(r["released_at"]))
    console.print(table)


@app.command()
def screenshot(
    serial: str = typer.Argument(..., help="Device serial.", autocompletion=completion.devices),
    out: Path = typer.Option(None, "--out", help="Also write the PNG here.", dir_okay=False),
    as_json: bool = JSON_OPTION,
):
    """Save the device's screen now as a PNG: an adb phone's through `screencap -p`, a browser
    device's page through Chromium's DevTools protocol. Kept under the farm's data dir (the
    newest is on the device's dashboard page and at GET /v1/devices/SERIAL/screenshot)."""
    from orchestrator import store
    from orchestrator.services.screenshots import take_screenshot
    from orchestrator.transports import NoScreen, TransportError

    settings = cli_settings()
    with open_store(settings) as sessions:
        try:
            taken = take_screenshot(settings, sessions, serial)
        except (store.StoreError, NoScreen) as exc:  # an unknown device, or one whose transport has no screen
            fail(str(exc))
        except TransportError as exc:  # the device did not answer, or answered nonsense
            could_not_run(str(exc))
    if out is not None:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(taken.path.read_bytes())
        except OSError as exc:
            fail(f"cannot write {out}: {exc.strerror or exc}; the screenshot is kept at {taken.path}")
    data = {"device": taken.serial, "path": str(taken.path), "out": str(out) if out is not None else None,
            "sha256": taken.sha256, "size": taken.size, "width": taken.width, "height": taken.height,
            "source": taken.source, "taken_at": taken.taken_at}
    if as_json:
        print_json(data)
        return
    console.print(f"{serial}'s screen ({taken.width}x{taken.height}, {taken.source}): {out or taken.path}",
                  highlight=False, markup=False, soft_wrap=True)


def _utc(stamp: str | None) -> str:
    return dt.datetime.fromisoformat(stamp).astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M UTC") if stamp else "-"


@app.command("set-address")
def set_address(
    serial: str = typer.Argument(..., help="Device serial.", autocompletion=completion.devices),
    address: str = typer.Argument(..., help=ADDRESS_HELP + " An empty string restores the default."),
):
    """Change how the farm reaches a device (its transport stays the same)."""
    from orchestrator import store

    with open_store(cli_settings()) as sessions, sessions() as session:
        try:
            device = store.get_device(session, serial)
        except store.StoreError as exc:
            fail(str(exc))
        # The transport comes from the store, so the address is checked here, not while parsing.
        if device.transport == TransportKind.local and address:
            address = validate.local_root(address)
        try:
            device.address = str(inputs.parse_device_address(device.transport, address))
        except inputs.BadInput as exc:
            raise typer.BadParameter(str(exc), param_hint="'ADDRESS'") from None
        session.commit()
        console.print(f"device {serial} ({device.transport}) is reached at {device.address or 'its default address'}",
                      highlight=False, markup=False)


def _set_state(serial: str, state: DeviceState, reason: str) -> None:
    from orchestrator import store

    with open_store(cli_settings()) as sessions, sessions() as session:
        try:  # the state machine refuses a release of a device that is not quarantined
            device = store.get_device(session, serial)
            store.set_device_state(session, device.id, state, reason, force=True)
        except store.StoreError as exc:
            fail(str(exc))
        session.commit()
    console.print(f"device {serial} is {state}" + (f": {reason}" if state == DeviceState.quarantined else ""),
                  highlight=False, markup=False)


def probe(settings, sessions, device: Device) -> dict[str, Any]:
    """Ask one device what it is and record the answer (orchestrator.jobs.health.probe); returns its
    listing with the error, if any, and `address_error` when its stored serial or address cannot
    be used (it is then not asked at all)."""
    from orchestrator import store
    from orchestrator.jobs import health

    outcome = health.probe(settings, sessions, device)
    with sessions() as session:
        row = store.get_device(session, outcome.device_id)
        return device_dict(row) | {"error": str(outcome.error) if outcome.error else None,
                                   "address_error": outcome.address_error}


@app.command()
def discover(as_json: bool = JSON_OPTION):
    """Probe every known device through its transport; record its identity and state.

    A device that does not answer is recorded offline. A device whose stored serial or address
    cannot be used is named with its fix, and the command exits 1."""
    from orchestrator import store

    settings = cli_settings()
    outcomes: list[dict[str, Any]] = []
    with open_store(settings) as sessions:
        with sessions() as session:
            devices = store.all_devices(session)
        if not devices and not as_json:
            console.print("no devices to probe; add one with `farm devices add`")
            return
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
        with Progress(*columns, console=console, transient=True, disable=as_json) as progress:
            task = progress.add_task("probing", total=len(devices))
            for device in devices:
                progress.update(task, description=f"probing {device.serial}")
                outcomes.append(probe(settings, sessions, device))
                progress.advance(task)
    bad = [o["address_error"] for o in outcomes if o["address_error"]]
    if as_json:
        print_json(outcomes)
    else:
        table = Table("serial", "state", "gpu", "note")
        for o in outcomes:
            note = "bad serial or address (below)" if o["address_error"] else o["error"] or o["state_reason"] or ""
            table.add_row(o["serial"], o["state"], o["gpu"]["device"] or "-", note)
        console.print(table)
        for message in bad:
            console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    if bad:
        raise typer.Exit(BAD_INPUT)  # a stored serial or address to fix


def _interactive() -> bool:
    # Ask only a person: under CI, a pipe or CliRunner there is no one to answer.
    return sys.stdin.isatty()


def _tcp_addresses(values: list[str] | None) -> list[str]:
    """--address of `farm devices scan`: adb HOST:PORT values, canonical."""
    addresses = []
    for value in values or []:
        try:
            parsed = inputs.parse_device_address("adb", value)
        except inputs.BadInput as exc:
            raise typer.BadParameter(str(exc)) from None
        if not isinstance(parsed, inputs.AdbTcpAddress):
            raise typer.BadParameter(f"{value!r} is not HOST:PORT; phones on USB are found without --address")
        addresses.append(str(parsed))
    return addresses


@app.command()
def scan(
    address: list[str] = typer.Option(None, "--address", help="Also probe this adb HOST:PORT (repeatable).",
                                      callback=_tcp_addresses),
    register: bool = typer.Option(False, "--register", "--yes", "-y",
                                  help="Register what answered and is not registered yet, without asking."),
    usb: bool = typer.Option(True, "--usb/--no-usb", help="Look for phones plugged in over USB."),
    as_json: bool = JSON_OPTION,
):
    """List what the ADB transport can see: phones on USB, the TCP addresses of the registered
    adb devices and each --address; probe each and say whether the farm knows it. Nothing is
    recorded unless registering.

    Offers to register the new ones (asked only on a terminal; --register for scripts). A phone
    that refuses this host's key is registered unauthorized, and the health check brings it in
    once the key is accepted on the phone."""
    from orchestrator.jobs import health

    settings = cli_settings()
    with open_store(settings) as sessions:
        with nullcontext() if as_json else console.status("scanning"):
            seen, usb_note = health.scan(settings, sessions, address or [], usb=usb)
        new = [entry for entry in seen if entry.registrable]
        if not as_json:
            _print_scan(seen, usb_note)
            if new and not register:
                if _interactive():
                    register = typer.confirm(f"register {len(new)} device(s) on host {settings.host_name}?",
                                             default=False)
                else:
                    console.print(f"{len(new)} not registered; run again with --register to register them",
                                  highlight=False)
        registered = health.register(settings, sessions, seen) if register and new else []
    if as_json:
        print_json({"usb": usb_note, "devices": [entry.as_dict() for entry in seen], "registered": registered})
        return
    for serial in registered:
        console.print(f"registered {serial}", highlight=False)


def _print_scan(seen, usb_note: str | None) -> None:
    if usb_note:
        console.print(f"[yellow]{escape(usb_note)}[/]", highlight=False)
    if not seen:
        console.print("nothing to scan: no phones on USB, no adb devices registered; give --address HOST:PORT")
        return
    table = Table("address", "source", "serial", "model", "gpu", "state", "registered as", "note")
    for entry in seen:
        note = entry.note or ("" if entry.state == DeviceState.available else entry.error or "")
        table.add_row(entry.address, entry.source, entry.serial or "-", entry.model or "-", entry.gpu or "-",
                      styled(entry.state, _STATE_STYLE[str(entry.state)]), entry.registered_as or "-", note)
    console.print(table)
