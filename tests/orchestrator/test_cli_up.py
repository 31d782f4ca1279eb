"""`farm up` drives the real devices registered on its host (a phone on USB the README's steps
add), beside or instead of its virtual ones."""

from __future__ import annotations

from orchestrator import store
from orchestrator.cli.stack import registered_here
from orchestrator.infra.settings import load_settings


def test_up_drives_the_real_devices_registered_here_and_no_other(cli):
    cli("devices", "add", "pixel-8", "--transport", "adb", "--address", "usb:ABC123", "--engine-host", "browser")
    cli("devices", "add", "iphone-15", "--transport", "web")
    with cli.Session() as session:
        store.upsert_device(session, "elsewhere-1", "adb", "10.0.0.9:5555", host="lab-2")
        store.upsert_device(session, "vphone-1", "adb", "127.0.0.1:6520", host="testhost")
        store.get_device(session, "vphone-1").virtual = True  # an earlier stack's virtual phone
        store.upsert_device(session, "host-gpu", "local", "/tmp/x", host="testhost")
        session.commit()
    assert registered_here(load_settings(), {"host-gpu"}) == ["iphone-15", "pixel-8"]


def test_up_with_nothing_to_drive_names_the_ways_to_add_a_device(cli):
    result = cli("up", "--phones", "0", "--no-host-gpu", ok=False)
    assert result.exit_code != 0
    assert "farm devices add" in result.output and "--phones" in result.output
    assert "Traceback" not in result.output
