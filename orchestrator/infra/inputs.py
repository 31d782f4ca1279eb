"""What the farm accepts from a user as a device address, a port, or a name that becomes part
of a path, with one parser for each. The `farm` CLI's options, `farm worker --device` and
FARM_DEVICES read these values through here, and so can anything that reads them back from the
store (the transport factory, `farm devices discover`), so a bad value is refused where it
enters, or named where it is found, with a message that says what is wrong and how to fix it.
Pure functions on strings: no CLI, no database, no network.

Device addresses, per transport (what `farm devices add --address` and SERIAL=TRANSPORT:ADDRESS
take):

| transport | address                                   | parsed as                            |
|-----------|-------------------------------------------|--------------------------------------|
| local     | "" or an absolute agent root folder        | LocalAddress(root or None)           |
| adb       | HOST:PORT, HOST (port 5555), [IPv6]:PORT  | AdbTcpAddress(host, port)            |
| adb       | usb:SERIAL, or "" (the only USB device)    | AdbUsbAddress(serial or None)        |
| http      | http(s)://HOST[:PORT][/PATH]               | HttpAddress(url, no trailing slash)  |
| web       | "" (nothing: the device opens the hub)     | WebAddress()                         |

`str()` of a parsed address is its canonical form, the one to store."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from agent.bundle import CURRENT, NAME_PATTERN

DEFAULT_ADB_PORT = 5555
TRANSPORTS = ("adb", "http", "local", "web")  # how the farm reaches a device

# A device serial or a host name becomes a file or folder name (<config_dir>/tokens/<serial>,
# <data_dir>/devices/<serial>, the broker's host.<name> queue): one plain path component. ':'
# is allowed because adb names network devices host:port.
SERIAL_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:+-]{0,127}")
_HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class BadInput(ValueError):
    """A value the farm cannot use; the message names the value and the fix."""


# ---- names that become paths ------------------------------------------------------------


def _plain(what: str, value: str, pattern: re.Pattern[str], allowed: str) -> str:
    if not pattern.fullmatch(value) or ".." in value:
        raise BadInput(f"{what} {value!r} is not a plain name: use {allowed} (at most 128 characters, "
                       "starting with a letter, digit or '_'; no '/', '..', spaces or control characters)")
    return value


def check_serial(value: str) -> str:
    """A device serial (it names the device's token file and its default agent root)."""
    return _plain("device serial", value, SERIAL_PATTERN, "letters, digits and . _ + - :")


def check_host_name(value: str) -> str:
    """A farm host name (it names the host's queue, host.<name>)."""
    return _plain("host name", value, SERIAL_PATTERN, "letters, digits and . _ + - :")


def check_build_name(value: str, what: str = "build name") -> str:
    """A build id: the folder <data_dir>/builds/<name> here and under builds/ on every device,
    so exactly what the agent accepts (agent/bundle.py NAME_PATTERN)."""
    _plain(what, value, NAME_PATTERN, "letters, digits and . _ + -")
    if value == CURRENT:
        raise BadInput(f"{what} {value!r} is reserved (devices keep their installed build under that name); "
                       "choose another")
    return value


def check_relative_path(what: str, value: str) -> str:
    """A path inside a build (models/<name>, profiles/<file>) or an absolute path on the device:
    no '..' component, no empty component, no control characters."""
    parts = value.rstrip("/").split("/")
    if not value or _CONTROL.search(value) or ".." in parts or any(p == "" for p in parts[1:]):
        raise BadInput(f"{what} {value!r} is not a clean path: give a path inside the build such as "
                       "models/tiny (no '..', '//', or control characters)")
    return value


# ---- ports and hosts --------------------------------------------------------------------


def parse_port(value: str | int, what: str = "port") -> int:
    """A TCP port to connect to: 1-65535."""
    try:
        port = int(str(value).strip(), 10)
    except ValueError:
        raise BadInput(f"{what} {str(value)!r} is not a number (a TCP port is 1 to 65535)") from None
    if not 1 <= port <= 65535:
        raise BadInput(f"{what} {port} is out of range (a TCP port is 1 to 65535)")
    return port


def check_host(value: str, what: str = "host") -> str:
    """A host name or an IP address (IPv6 without brackets); returned without brackets."""
    host = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    if not host or len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise BadInput(f"{what} {value!r} is not a host name or an IP address (e.g. 10.0.0.7, phone-1.lab, "
                       "[fe80::1])")
    return host


# ---- device addresses -------------------------------------------------------------------


@dataclass(frozen=True)
class LocalAddress:
    """A local device's agent root folder; None: the default, <data_dir>/devices/<serial>."""

    root: Path | None

    def __str__(self) -> str:
        return "" if self.root is None else str(self.root)


@dataclass(frozen=True)
class AdbTcpAddress:
    """A phone reached over ADB on TCP; `host` is bare (no IPv6 brackets)."""

    host: str
    port: int = DEFAULT_ADB_PORT

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class AdbUsbAddress:
    """A phone plugged in over USB; `serial` None: the only one attached."""

    serial: str | None = None

    def __str__(self) -> str:
        return f"usb:{self.serial}" if self.serial else ""


@dataclass(frozen=True)
class HttpAddress:
    """A network agent's base URL (http or https), without a trailing slash."""

    url: str

    def __str__(self) -> str:
        return self.url


@dataclass(frozen=True)
class WebAddress:
    """A browser device that opens the farm's hub itself (over HTTPS): the farm holds no address
    of it; the hub's URL is the farm's (settings hub_public_host, hub_https_port)."""

    def __str__(self) -> str:
        return ""


DeviceAddress = LocalAddress | AdbTcpAddress | AdbUsbAddress | HttpAddress | WebAddress

_ADB_FORMS = "give HOST:PORT (e.g. 10.0.0.7:5555), HOST (port 5555), [IPv6]:PORT or usb:SERIAL"
_HTTP_FORMS = "give the agent's URL, e.g. http://10.0.0.7:8765 or https://phone-1.lab:8765"


def parse_device_address(transport: str, address: str) -> DeviceAddress:
    """The typed address of a device reached through `transport` (adb, http or local);
    BadInput naming the address, what is wrong and the forms that work."""
    kind = str(transport)
    if kind not in TRANSPORTS:
        raise BadInput(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORTS)}")
    if _CONTROL.search(address) or address != address.strip():
        raise BadInput(f"{kind} address {address!r} holds spaces or control characters; "
                       + {"adb": _ADB_FORMS, "http": _HTTP_FORMS, "local": "give an absolute folder",
                          "web": "leave it out"}[kind])
    if kind == "local":
        return _local(address)
    if kind == "adb":
        return _adb(address)
    if kind == "web":
        if address:
            raise BadInput(f"web address {address!r}: a web device has no address (it opens the farm's hub "
                           "itself); leave --address out")
        return WebAddress()
    return _http(address)


def _local(address: str) -> LocalAddress:
    if not address:
        return LocalAddress(None)
    root = Path(address).expanduser()
    if not root.is_absolute():
        raise BadInput(f"local address {address!r} is a relative folder; give the agent root as an absolute "
                       "path (workers may run in another folder)")
    return LocalAddress(root)


def _adb(address: str) -> AdbTcpAddress | AdbUsbAddress:
    def bad(why: str) -> BadInput:
        return BadInput(f"adb address {address!r}: {why}; {_ADB_FORMS}")

    if not address:
        return AdbUsbAddress(None)
    if "://" in address:
        raise bad(f"adb does not take a URL ({address.split('://', 1)[0]}://); that form is for --transport http")
    if address.startswith("usb:"):
        serial = address.removeprefix("usb:")
        if not serial:
            return AdbUsbAddress(None)
        try:
            return AdbUsbAddress(check_serial(serial))
        except BadInput as exc:
            raise bad(str(exc)) from None
    if address.startswith("["):
        host, sep, port = address[1:].partition("]")
        if not sep or (port and not port.startswith(":")):
            raise bad("an IPv6 address goes in brackets, followed by :PORT")
        port = port.removeprefix(":")
    elif address.count(":") > 1:
        raise bad("an IPv6 address goes in brackets")
    else:
        host, sep, port = address.partition(":")
        if sep and not port:
            raise bad("the port after ':' is missing")
    try:
        return AdbTcpAddress(check_host(host), parse_port(port) if port else DEFAULT_ADB_PORT)
    except BadInput as exc:
        raise bad(str(exc)) from None


def _http(address: str) -> HttpAddress:
    def bad(why: str) -> BadInput:
        return BadInput(f"http address {address!r}: {why}; {_HTTP_FORMS}")

    if not address:
        raise bad("an http device needs its agent's URL")
    if "://" not in address:
        raise bad(f"the scheme is missing (http://{address}?)")
    parts = urlsplit(address)
    if parts.scheme not in ("http", "https"):
        raise bad(f"the scheme must be http or https, not {parts.scheme or 'missing'!r}")
    if parts.username is not None or parts.password is not None:
        raise bad("no user or password in the URL (the agent's token goes in <config_dir>/tokens/SERIAL)")
    if parts.query or parts.fragment:
        raise bad("no query or fragment")
    if parts.netloc.rpartition("]")[2].count(":"):
        try:
            parse_port(parts.netloc.rpartition(":")[2])
        except BadInput as exc:
            raise bad(str(exc)) from None
    try:
        check_host(parts.hostname or "")
    except BadInput as exc:
        raise bad(str(exc)) from None
    return HttpAddress(f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}")
