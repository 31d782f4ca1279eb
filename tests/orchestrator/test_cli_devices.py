"""`farm devices scan` through CliRunner, on SQLite and PostgreSQL: a virtual phone at a given
address is listed and registered (asked on a terminal only, never waiting for input without
one), is then known by its registered address, a phone that refuses this host is registered
unauthorized and comes in once its key is accepted, USB is reported as not scanned when
adb-shell's usb extra is missing, and what the state machine refuses reaches the user as one
line."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from agent.simulator import VirtualPhone
from orchestrator.cli import app
from orchestrator.jobs import health
from orchestrator.transports.adb import load_or_create_adb_key


def _farm_key(cli):
    """This farm's ADB key (<config_dir>/adbkey), made as the transport makes it."""
    return load_or_create_adb_key(cli.tmp / "config" / "adbkey")


@pytest.fixture
def phone(cli_db):
    key = _farm_key(cli_db)
    with VirtualPhone(serial="vphone-scan", root=cli_db.tmp / "phone", adb_keys=key.with_name("adbkey.pub")) as p:
        yield p


def _scan(cli, *args: str) -> dict:
    return json.loads(cli("devices", "scan", "--json", *args).output)


def test_scan_lists_then_registers_a_phone(cli_db, phone):
    cli, address = cli_db, f"127.0.0.1:{phone.port}"
    found = _scan(cli, "--address", address)
    assert found["usb"].startswith("USB not scanned: adb-shell's usb extra is not installed")
    assert found["registered"] == []
    [entry] = found["devices"]
    del entry["gpu"]  # the adapter the phone's agent runs on: whatever this machine has
    assert entry == {"address": address, "source": "given", "serial": "vphone-scan", "model": "Virtual Pixel 7",
                     "state": "available", "error": None, "registered_as": None, "registrable": True, "note": None}
    assert json.loads(cli("devices", "list", "--json").output) == []  # a scan records nothing

    # No terminal: the table, and how to register, without waiting for an answer.
    listed = cli("devices", "scan", "--address", address)
    assert "vphone-scan" in listed.output and "1 not registered; run again with --register" in listed.output
    assert json.loads(cli("devices", "list", "--json").output) == []

    registered = cli("devices", "scan", "--address", address, "--register")
    assert "registered vphone-scan" in registered.output
    [device] = json.loads(cli("devices", "list", "--json").output)
    assert (device["serial"], device["address"], device["state"], device["host"], device["model"]) == (
        "vphone-scan", address, "available", "testhost", "Virtual Pixel 7")
    assert device["last_seen"] is not None

    # Known now: its registered address is scanned without --address, and not offered again.
    again = _scan(cli, "--register")
    assert again["registered"] == []
    assert [(d["address"], d["source"], d["registered_as"], d["registrable"]) for d in again["devices"]] == [
        (address, "registered", "vphone-scan", False)]


def test_scan_asks_on_a_terminal(cli_db, phone, monkeypatch):
    from orchestrator.cli import devices

    address = f"127.0.0.1:{phone.port}"
    monkeypatch.setattr(devices, "_interactive", lambda: True)
    runner = CliRunner()
    declined = runner.invoke(app, ["devices", "scan", "--no-usb", "--address", address], input="n\n")
    assert declined.exit_code == 0, declined.output
    assert "register 1 device(s) on host testhost? [y/N]" in declined.output
    assert json.loads(cli_db("devices", "list", "--json").output) == []
    accepted = runner.invoke(app, ["devices", "scan", "--no-usb", "--address", address], input="y\n")
    assert accepted.exit_code == 0, accepted.output
    assert "registered vphone-scan" in accepted.output
    assert [d["serial"] for d in json.loads(cli_db("devices", "list", "--json").output)] == ["vphone-scan"]


def test_scan_registers_a_phone_that_refuses_this_host_unauthorized(cli):
    """The phone does not know this host's key (it waits for someone to tap "Allow"): it is
    registered unauthorized under its HOST:PORT, and the first probe after the key is accepted
    finds it available."""
    key = _farm_key(cli)
    trusted = cli.tmp / "phone-trusted.pub"  # what the phone trusts: nothing yet
    with VirtualPhone(serial="vphone-shy", root=cli.tmp / "phone", adb_keys=trusted) as phone:
        address = f"127.0.0.1:{phone.port}"
        found = _scan(cli, "--no-usb", "--address", address, "--register")
        assert found["usb"] is None
        [entry] = found["devices"]
        assert (entry["state"], entry["serial"], entry["registrable"]) == ("unauthorized", address, True)
        assert "did not accept this host's RSA key" in entry["error"]
        assert found["registered"] == [address]
        shown = json.loads(cli("devices", "show", address, "--json").output)
        assert shown["state"] == "unauthorized" and "tap 'Allow'" in shown["state_reason"]

        shutil.copy(key.with_name("adbkey.pub"), trusted)  # "Allow" tapped on the phone
        [probed] = json.loads(cli("devices", "discover", "--json").output)
        assert (probed["serial"], probed["state"], probed["model"]) == (address, "available", "Virtual Pixel 7")


def test_scan_reports_usb_phones_it_cannot_reach(cli, monkeypatch):
    """A USB phone whose transport cannot open it is listed offline and not offered."""
    monkeypatch.setattr(health, "usb_serials", lambda: (["R5CW1234"], None))
    found = _scan(cli, "--register")
    [entry] = found["devices"]
    assert (entry["address"], entry["source"], entry["state"], entry["registrable"]) == (
        "usb:R5CW1234", "usb", "offline", False)
    assert "usb extra" in entry["error"] and found["registered"] == [] and found["usb"] is None
    assert "no phones on USB" in cli("devices", "scan", "--no-usb").output


def test_scan_refuses_a_bad_address(cli):
    for bad, why in (("usb:R5CW1234", "not HOST:PORT"), ("10.0.0.7:99999", "port")):
        result = cli("devices", "scan", "--address", bad, ok=False)
        assert result.exit_code == 3 and why in result.output, result.output


def test_state_machine_refusals_are_one_line(cli_db):
    cli = cli_db
    cli("devices", "add", "phone-1", "--transport", "adb", "--address", "127.0.0.1:9")
    refused = cli("devices", "release", "phone-1", ok=False)
    assert refused.exit_code == 3
    assert refused.output.strip() == ("error: device 'phone-1': release refused: it is offline, not quarantined, "
                                      "and only a quarantined device is released (docs/devices.md)")
    cli("devices", "quarantine", "phone-1", "--reason", "swollen battery")
    assert json.loads(cli("devices", "discover", "--json").output)[0]["state"] == "quarantined"  # sticky
    cli("devices", "release", "phone-1")
    assert json.loads(cli("devices", "show", "phone-1", "--json").output)["state"] == "available"


def test_a_browser_device_is_added_over_adb_and_reached_through_its_browser(cli_db):
    from orchestrator.infra.settings import load_settings
    from orchestrator.store.models import Device
    from orchestrator.transports.browser import AdbPageLink, BrowserTransport
    from orchestrator.transports.factory import make_transport

    cli = cli_db
    added = cli("devices", "add", "pixel-8", "--transport", "adb", "--address", "127.0.0.1:5999",
                "--engine-host", "browser")
    assert "engine on browser" in added.output
    cli("devices", "add", "pixel-6", "--transport", "adb", "--address", "127.0.0.1:5998")
    listed = {d["serial"]: (d["transport"], d["engine_host"]) for d in json.loads(cli("devices", "list", "--json").output)}
    assert listed == {"pixel-8": ("adb", "browser"), "pixel-6": ("adb", "python")}
    refused = cli("devices", "add", "mac", "--transport", "http", "--address", "http://10.0.0.2:8765",
                  "--engine-host", "browser", ok=False)
    assert "reached over adb" in refused.output

    settings = load_settings()
    with cli.Session() as session:
        device = session.query(Device).filter_by(serial="pixel-8").one()
        transport = make_transport(device, settings)
    assert isinstance(transport, BrowserTransport) and isinstance(transport.link, AdbPageLink)
    token_file = settings.config_dir / "tokens" / "browser" / "pixel-8"
    assert transport.token == token_file.read_text().strip() and oct(token_file.stat().st_mode & 0o777) == "0o600"
    assert transport.enrolment_url().startswith("http://localhost:8790/web/index.html#device=pixel-8&token=")


def test_a_web_device_is_added_with_the_url_and_qr_code_it_opens_once(cli_db):
    cli = cli_db
    added = cli("devices", "add", "ipad-1", "--transport", "web")
    out = added.output
    url = next(line for line in out.splitlines() if line.startswith("https://"))
    assert url.startswith("https://testhost:8743/web/index.html#device=ipad-1&token=") and "&key=" in url
    assert "▀" in out or "▄" in out or "█" in out  # the QR code, in half blocks
    assert "farm hub" in out  # no CA yet: where it comes from
    [device] = json.loads(cli("devices", "list", "--json").output)
    assert (device["transport"], device["engine_host"], device["address"]) == ("web", "browser", "")
    again = cli("devices", "enrol", "ipad-1").output
    assert url in again  # the same token: the page already enrolled keeps working
    refused = cli("devices", "add", "ipad-2", "--transport", "web", "--address", "https://x:1", ok=False)
    assert "has no address" in refused.output
    cli("devices", "add", "pixel-9", "--transport", "adb", "--address", "127.0.0.1:5997")
    assert "the farm opens its page itself" in cli("devices", "enrol", "pixel-9", ok=False).output
