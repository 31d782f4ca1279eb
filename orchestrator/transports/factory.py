"""The transport factory: the Transport that reaches a device, from what the store keeps of it
(its serial, transport kind, address and engine host; any object with those attributes, a device
row included) and the settings (keys, tokens, the hub). The job path (orchestrator/jobs/worker.py,
orchestrator/jobs/health.py) and the CLI's checks build every transport here."""

from __future__ import annotations

from typing import Protocol

from orchestrator.infra.settings import Settings
from orchestrator.transports.base import Transport


class DeviceRecord(Protocol):
    """What the factory reads of a device (orchestrator.store.models.Device has it)."""

    serial: str
    transport: str
    address: str | None
    engine_host: str | None


def make_transport(device: DeviceRecord, settings: Settings) -> Transport:
    """The transport for a device row: `address` is the agent root (local; default
    <data_dir>/devices/<serial>), host:port or usb:SERIAL (adb), or the agent's URL (http, with
    its token in <config_dir>/tokens/<serial>); adb signs with <config_dir>/adbkey. A device of
    the browser executor is reached over adb too, its engine run by its browser. ValueError
    (orchestrator.infra.inputs.BadInput) names a stored address that cannot be used."""
    from orchestrator.infra.inputs import (
        AdbTcpAddress,
        HttpAddress,
        LocalAddress,
        WebAddress,
        parse_device_address,
    )

    address = parse_device_address(str(getattr(device.transport, "value", device.transport)), device.address or "")
    if isinstance(address, WebAddress):
        return browser_transport(device, None, settings)
    if isinstance(address, LocalAddress):
        from orchestrator.transports.local import LocalTransport

        return LocalTransport(address.root or settings.data_dir / "devices" / device.serial, name=device.serial)
    if isinstance(address, HttpAddress):
        from orchestrator.transports.http import HttpTransport

        return HttpTransport.from_token_file(address.url, settings.config_dir / "tokens" / device.serial,
                                             name=device.serial)
    from orchestrator.transports.adb import AdbTransport

    if isinstance(address, AdbTcpAddress):
        adb = AdbTransport(address.host, address.port, key_path=settings.adb_key, name=device.serial)
    else:
        adb = AdbTransport(usb_serial=address.serial, key_path=settings.adb_key, name=device.serial)
    if device.engine_host == "browser":
        return browser_transport(device, adb, settings)
    return adb


def browser_transport(device: DeviceRecord, adb, settings: Settings) -> Transport:
    """A device whose browser runs the engine: its host-side agent root
    <data_dir>/devices/<serial>, its page's token in <config_dir>/tokens/browser/<serial> (made
    on first use, 0600), the farm's public key the page is enrolled with. A phone over adb
    (`adb` given) goes through this host's `farm hub` when one runs, else a hub of the worker's
    own; a web device needs `farm hub`, whose HTTPS address it opens."""
    from orchestrator.infra.keys import PUBLIC_KEY, ensure_farm_key
    from orchestrator.transports.base import DeviceOffline
    from orchestrator.transports.browser import (
        AdbPageLink,
        BrowserTransport,
        WebPageLink,
        public_url,
        running_hub,
    )
    from orchestrator.transports.hub import read_or_make_token

    ensure_farm_key(settings.config_dir)
    token = read_or_make_token(settings.browser_tokens_dir / device.serial)
    hub = running_hub(settings)
    if adb is None and hub is None:
        raise DeviceOffline(device.serial, "no `farm hub` answers on this host: a web device reaches the farm "
                            "through it; start it (`farm up` and `farm demo` do)")
    link = AdbPageLink(adb) if adb is not None else WebPageLink(public_url(settings), device.serial)
    return BrowserTransport(settings.data_dir / "devices" / device.serial, link, token,
                            settings.config_dir / PUBLIC_KEY, name=device.serial, hub=hub)
