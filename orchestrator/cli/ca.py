"""`farm ca ...`: the farm's own certificate authority (orchestrator/infra/ca.py), in <config_dir>/ca.
`init` makes it, `export` writes its certificate for devices to install (PEM, DER for Android,
a configuration profile for iOS), `show` says what it is and where its files are, and `issue`
writes or renews the server certificate the farm's HTTPS pages present."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any

import typer

from orchestrator.infra import ca

from . import validate
from .common import JSON_OPTION, cli_settings, fail, print_json
from .output import console, escape, field

app = typer.Typer(help="The farm's certificate authority: the CA devices trust for the farm's HTTPS pages.",
                  no_args_is_help=True)

# Where each export goes on a device, printed after writing it.
INSTALL_HINTS = {
    "pem": "import it as a trusted certificate authority in the browser's or the system's certificate manager",
    "der": "on Android: Settings > Security > Encryption & credentials > Install a certificate > CA certificate",
    "mobileconfig": "on iOS/iPadOS: open it on the device, install it in Settings > General > VPN & Device "
                    "Management (it shows as Not Signed), then switch on full trust in Settings > General > "
                    "About > Certificate Trust Settings",
}


class Format(StrEnum):
    pem = "pem"
    der = "der"
    mobileconfig = "mobileconfig"


def _folder() -> Path:
    return ca.default_dir(cli_settings().config_dir)


def _server_dict(server: ca.ServerCert) -> dict[str, Any]:
    return {"cert": str(server.cert), "key": str(server.key), "names": list(server.names),
            "not_after": server.not_after.isoformat(), "fingerprint": server.fingerprint}


@app.command()
def init(
    name: str = typer.Option(None, "--name", help="The CA's name, as devices list it (default: devicefarm CA "
                             "<host name>).", show_default=False),
    force: bool = typer.Option(False, "--force", help="Replace an existing CA (every device must then install "
                               "the new one)."),
    names: list[str] = typer.Option(None, "--name-constraint", help="A host name (with its subdomains) or IP "
                                    "address the CA may vouch for (repeatable; default: hub_names, else this "
                                    "host's name, localhost and 127.0.0.1)."),
):
    """Make the farm's CA: an EC P-256 key (0600) and a CA certificate valid for two years that
    can vouch only for the lab's names."""
    _make(name, names, force=force, made="made")


@app.command()
def rotate(
    name: str = typer.Option(None, "--name", help="The new CA's name (default: devicefarm CA <host name>).",
                             show_default=False),
    names: list[str] = typer.Option(None, "--name-constraint", help="A host name or IP address the new CA may "
                                    "vouch for (repeatable; default: hub_names, else this host's name, "
                                    "localhost and 127.0.0.1)."),
):
    """Replace the farm's CA with a new one (new key, new names, two more years): before the old
    one ends, when its key may have leaked, or for names it may not vouch for. Every device
    must then install the new one; the hub serves a certificate of the new CA from its next
    start."""
    _make(name, names, force=True, made="rotated: made the new")


def _make(name: str | None, names: list[str] | None, *, force: bool, made: str) -> None:
    settings = cli_settings()
    folder = ca.default_dir(settings.config_dir)
    name = name if name is not None else f"{ca.DEFAULT_CA_NAME} {settings.host_name}"[:64]
    try:
        cert = ca.init_ca(folder, name, names=names or settings.hub_cert_names(), force=force)
    except ca.CaError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write the CA into {folder}: {exc}")
    console.print(f"{made} farm CA [bold]{escape(cert.subject.rfc4514_string())}[/] in {folder}", highlight=False,
                  soft_wrap=True)
    console.print(f"SHA-256 fingerprint: {ca.fingerprint(cert)}", highlight=False, soft_wrap=True)
    field(console, "may vouch for", ", ".join(ca.permitted_names(cert) or []))
    field(console, "valid until", f"{cert.not_valid_after_utc:%Y-%m-%d}")
    console.print("next: `farm ca export farm-ca.mobileconfig` (iOS) or `farm ca export farm-ca.cer` (Android), "
                  "and install it on each device", highlight=False, soft_wrap=True)


@app.command()
def export(
    path: Path = typer.Argument(..., help="File to write: .pem/.crt (PEM), .cer (DER, Android), .mobileconfig (iOS).",
                                callback=validate.output_file),
    format: Format = typer.Option(None, "--format", help="Format to write (default: from PATH's suffix).",
                                  case_sensitive=False, show_default=False),
):
    """Write the CA certificate (never its key) for devices to install."""
    folder = _folder()
    try:
        kind = ca.export_format(path, format.value if format is not None else None)
        ca.export_ca(folder, path, kind)
        cert = ca.load_ca_cert(folder)
    except ca.CaError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write {path}: {exc}")
    console.print(f"wrote {path} ({kind}): {cert.subject.rfc4514_string()}", highlight=False, soft_wrap=True)
    console.print(f"SHA-256 fingerprint: {ca.fingerprint(cert)} (compare it on the device)", highlight=False,
                  soft_wrap=True)
    console.print(f"install: {INSTALL_HINTS[kind]}", highlight=False, soft_wrap=True)


@app.command()
def show(as_json: bool = JSON_OPTION):
    """Show the CA (subject, validity, fingerprint), its server certificate and where the files are."""
    folder = _folder()
    try:
        cert = ca.load_ca_cert(folder)
        server = ca.server_cert_info(folder)
    except ca.CaError as exc:
        fail(str(exc))
    data = {
        "folder": str(folder),
        "subject": cert.subject.rfc4514_string(),
        "not_before": cert.not_valid_before_utc.isoformat(),
        "not_after": cert.not_valid_after_utc.isoformat(),
        "fingerprint": ca.fingerprint(cert),
        "permitted_names": ca.permitted_names(cert),
        "cert": str(folder / ca.CA_CERT),
        "key": str(folder / ca.CA_KEY),
        "server": _server_dict(server) if server is not None else None,
    }
    if as_json:
        print_json(data)
        return
    # One line a value: the fingerprint is what a person compares on the phone, so it is never
    # cut or folded inside a table cell, whatever the terminal's width.
    field(console, "subject", data["subject"])
    field(console, "valid", f"{cert.not_valid_before_utc:%Y-%m-%d} to {cert.not_valid_after_utc:%Y-%m-%d}")
    permitted = data["permitted_names"]
    field(console, "may vouch for", ", ".join(permitted) if permitted is not None else
          "any name (a CA made before name constraints: `farm ca rotate` replaces it)")
    field(console, "SHA-256 fingerprint", data["fingerprint"])
    field(console, "certificate", data["cert"])
    field(console, "key", data["key"])
    if server is None:
        field(console, "server", "no server certificate yet (`farm ca issue NAME...` writes one)")
    else:
        field(console, "server", f"{', '.join(server.names)} until {server.not_after:%Y-%m-%d}")
        field(console, "server certificate", server.cert)
        field(console, "server key", server.key)


@app.command()
def issue(
    names: list[str] = typer.Argument(..., help="Host names and IP addresses the farm's pages are reached at "
                                      "(e.g. farm.lan 10.0.0.5 localhost)."),
    as_json: bool = JSON_OPTION,
):
    """Write the server certificate for NAMES, or renew it (new names, or 30 days or less left)."""
    folder = _folder()
    try:
        server = ca.issue_server_cert(folder, names)
    except ca.CaError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write the server certificate into {folder}: {exc}")
    if as_json:
        print_json({**_server_dict(server), "issued": server.issued})
        return
    what = "issued" if server.issued else "kept (it covers these names already)"
    console.print(f"server certificate {what}: {server.cert}", highlight=False, soft_wrap=True)
    console.print(f"covers: {', '.join(server.names)}; valid until {server.not_after:%Y-%m-%d}", highlight=False,
                  soft_wrap=True)
