"""`farm devices screenshot`: a virtual phone's screen through `screencap -p` over real ADB (the
PNG the phone draws of its state: awake, asleep), a browser device's page through Chromium's
DevTools protocol (the phone's headless Chromium, reached on localabstract:chrome_devtools_remote),
each kept under the data dir, recorded, and served by the API with the device's reservation;
devices that show no screen, and a phone whose Chrome is not running, are refused in one line."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
from ci_support import missing
from fastapi.testclient import TestClient
from support import wait_until

from agent.simulator import VirtualPhone
from engine.browser import find_chromium
from orchestrator import store
from orchestrator.api import tokens
from orchestrator.api.app import create_app
from orchestrator.infra.settings import Settings
from orchestrator.transports.adb import AdbTransport, load_or_create_adb_key
from orchestrator.transports.base import ProtocolMismatch, png_size
from orchestrator.transports.local import LocalTransport


def png_header(data: bytes) -> tuple[int, int]:
    """The PNG's IHDR size, after checking its signature and the IHDR chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert (length, kind) == (13, b"IHDR")
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29])
    return struct.unpack(">II", data[16:24])


def pixels(data: bytes) -> set[bytes]:
    """The distinct RGB pixels of one of our 8-bit RGB PNGs (one IDAT, no filter)."""
    idat = data.index(b"IDAT")
    (length,) = struct.unpack(">I", data[idat - 4:idat])
    width, _ = png_header(data)
    raw = zlib.decompress(data[idat + 4:idat + 4 + length])
    stride = 1 + 3 * width
    return {raw[row + 1 + 3 * x:row + 4 + 3 * x] for row in range(0, len(raw), stride) for x in range(width)}


@pytest.fixture
def phone(cli):
    """A virtual phone that accepts the farm's adb key (<config_dir>/adbkey), registered as vphone-1."""
    key = load_or_create_adb_key(cli.tmp / "config" / "adbkey")
    with VirtualPhone(serial="vphone-1", root=cli.tmp / "phone", adb_keys=key.with_name(key.name + ".pub")) as p:
        p.adb = AdbTransport("127.0.0.1", p.port, key_path=key, name="vphone-1")
        yield p
        p.adb.close()


def api(cli) -> tuple[TestClient, dict[str, str]]:
    settings = Settings(data_dir=cli.tmp / "data", config_dir=cli.tmp / "config", host_name="testhost",
                        database_url=f"sqlite:///{cli.tmp / 'farm.db'}")
    with cli.Session() as s, s.begin():
        secret = tokens.create_token(s, "read", "screens")[1]
    return TestClient(create_app(settings)), {"Authorization": f"Bearer {secret}"}


def test_a_virtual_phone_screenshot_over_adb(cli, phone):
    cli("devices", "add", "vphone-1", "--transport", "adb", "--address", f"127.0.0.1:{phone.port}")
    taken = json.loads(cli("devices", "screenshot", "vphone-1", "--out", str(cli.tmp / "shot.png"), "--json").output)
    data = (cli.tmp / "shot.png").read_bytes()
    assert png_header(data) == (360, 800) == (taken["width"], taken["height"])
    assert taken["source"] == "adb" and taken["size"] == len(data)
    kept = cli.tmp / "data" / "screenshots" / "vphone-1"
    assert [p.read_bytes() for p in kept.iterdir()] == [data]
    assert (255, 255, 255) not in {tuple(p) for p in pixels(data)}  # Chrome is not running: the launcher
    # the picture is the phone's state: asleep, a dark screen
    phone.adb.shell("input keyevent KEYCODE_SLEEP")
    cli("devices", "screenshot", "vphone-1", "--out", str(cli.tmp / "asleep.png"))
    assert pixels((cli.tmp / "asleep.png").read_bytes()) == {b"\0\0\0"}
    # the API: the newest screenshot's PNG, and the device's payload names it and its holder
    cli("devices", "reserve", "vphone-1", "--for", "1h", "--as", "ana", "--note", "camera bug")
    client, auth = api(cli)
    with client:
        served = client.get("/v1/devices/vphone-1/screenshot", headers=auth)
        assert served.status_code == 200 and served.headers["content-type"] == "image/png"
        assert served.content == (cli.tmp / "asleep.png").read_bytes()
        device = client.get("/v1/devices/vphone-1", headers=auth).json()
        assert (device["reserved_by"], device["reservation_note"]) == ("ana", "camera bug")
        assert device["reserved_until"] and device["screenshot"]["url"] == "/v1/devices/vphone-1/screenshot"
        assert device["screenshot"]["source"] == "adb" and device["screenshot"]["width"] == 360
        [listed] = client.get("/v1/devices", headers=auth).json()
        assert listed["reserved_by"] == "ana" and listed["screenshot"]["sha256"] == device["screenshot"]["sha256"]


def test_the_api_says_when_there_is_no_screenshot(cli):
    cli("devices", "add", "vphone-2", "--transport", "adb", "--address", "127.0.0.1:5999")
    client, auth = api(cli)
    with client:
        missing_shot = client.get("/v1/devices/vphone-2/screenshot", headers=auth)
        assert missing_shot.status_code == 404 and "farm devices screenshot vphone-2" in missing_shot.text
        assert client.get("/v1/devices/vphone-2", headers=auth).json()["screenshot"] is None


def test_a_browser_device_screenshot_is_its_page_through_devtools(cli, phone):
    if not find_chromium():
        missing("no chromium: bash scripts/ensure-chromium.sh installs it", "CI needs it")
    cli("devices", "add", "vphone-1", "--transport", "adb", "--address", f"127.0.0.1:{phone.port}",
        "--engine-host", "browser")
    refused = cli("devices", "screenshot", "vphone-1", ok=False)  # Chrome not running: no DevTools socket
    assert refused.exit_code == 4 and "is com.android.chrome running?" in refused.output
    assert "\n" not in refused.output.strip()
    phone.adb.shell("am start -a android.intent.action.MAIN com.android.chrome")
    assert wait_until(lambda: phone.apps.devtools_port("com.android.chrome"), 60.0)  # Chrome listens
    taken = json.loads(cli("devices", "screenshot", "vphone-1", "--out", str(cli.tmp / "page.png"), "--json").output)
    data = (cli.tmp / "page.png").read_bytes()
    assert taken["source"] == "devtools"
    assert png_header(data) == (taken["width"], taken["height"]) and taken["width"] > 100 and taken["height"] > 100
    with cli.Session() as s:
        shot = store.latest_screenshot(s, store.get_device(s, "vphone-1").id)
        assert (shot.source, shot.sha256, shot.size) == ("devtools", taken["sha256"], len(data))


def test_a_device_without_a_screen_is_refused_in_one_line(cli):
    cli("devices", "add", "gpu-1", "--transport", "local")
    result = cli("devices", "screenshot", "gpu-1", ok=False)
    assert result.exit_code == 3  # bad input: this device has no screen to take
    assert result.output.strip().startswith("error: gpu-1: no screenshot: the farm reaches it over local")
    assert "\n" not in result.output.strip()


def test_an_answer_that_is_not_a_png_is_named(tmp_path):
    assert png_size(b"\x89PNG\r\n\x1a\n" + b"\0" * 8) is None
    with pytest.raises(ProtocolMismatch, match="screencap -p did not answer with a PNG: /system/bin/sh: screencap"):
        LocalTransport(tmp_path, name="p1").checked_png(b"/system/bin/sh: screencap: not found\n", "adb", "screencap -p")


@pytest.mark.parametrize("answer,message", [
    ("<html>", "not JSON"),
    ('{"id": 1, "error": "boom"}', "Page.captureScreenshot: boom"),
    ('{"id": 1, "error": {"message": "no page"}}', "Page.captureScreenshot: no page"),
    ('{"id": 1, "result": {}}', "no base64 image"),
    ('{"id": 1, "result": {"data": "!!not base64!!"}}', "no base64 image"),
    ('{"id": 1, "result": "x"}', "no base64 image"),
])
def test_a_browser_answering_nonsense_is_one_devtools_error(monkeypatch, answer, message):
    """Whatever a confused or hostile browser answers to Page.captureScreenshot (not JSON, an
    error that is a string, no image, no base64) is a DevToolsError naming it, which the browser
    transport reports as the device's fault in one line, never a traceback."""
    import contextlib

    from orchestrator.transports import devtools

    class Socket:
        def __init__(self, texts):
            self.texts = list(texts)

        def send_text(self, text):
            pass

        def receive_text(self):
            return self.texts.pop(0)

    pages = json.dumps([{"type": "page", "url": "https://h/web/", "webSocketDebuggerUrl": "ws://h/devtools/page/1"}])
    monkeypatch.setattr(devtools, "_send", lambda channel, data, timeout_s: None)
    monkeypatch.setattr(devtools, "_http_response", lambda channel, timeout_s: (200, pages.encode()))
    monkeypatch.setattr(devtools.WebSocket, "open", classmethod(
        lambda cls, channel, path, timeout_s: Socket(['{"method": "Page.frameNavigated"}', answer])))
    with pytest.raises(devtools.DevToolsError, match=message):
        devtools.capture_screenshot(lambda: contextlib.nullcontext(None))
    png = b"\x89PNG\r\n\x1a\n"
    monkeypatch.setattr(devtools.WebSocket, "open", classmethod(lambda cls, channel, path, timeout_s: Socket(
        [json.dumps({"id": 1, "result": {"data": __import__("base64").b64encode(png).decode()}})])))
    assert devtools.capture_screenshot(lambda: contextlib.nullcontext(None)) == png


def test_a_page_not_attached_yet_is_asked_again_and_a_page_that_stays_so_is_named(monkeypatch):
    """Chromium answers "Not attached to an active page" while a page it has just opened has no
    renderer yet (a browser started a moment before: CI saw it). The capture lists the targets
    and asks again until the page answers, for at most SETTLE_S; past that, the error is the
    browser's own, in one line. Other errors are not retried."""
    import contextlib

    from orchestrator.transports import devtools

    png = b"\x89PNG\r\n\x1a\n"
    not_attached = json.dumps({"id": 1, "error": {"code": -32000, "message": "Not attached to an active page"}})
    image = json.dumps({"id": 1, "result": {"data": __import__("base64").b64encode(png).decode()}})
    answers, listed = [], []

    class Socket:
        def send_text(self, text):
            pass

        def receive_text(self):
            return answers.pop(0)

    pages = json.dumps([{"type": "page", "url": "https://h/web/", "webSocketDebuggerUrl": "ws://h/devtools/page/1"}])
    monkeypatch.setattr(devtools, "_send", lambda channel, data, timeout_s: None)
    monkeypatch.setattr(devtools, "_http_response", lambda channel, timeout_s: listed.append(1) or (200, pages.encode()))
    monkeypatch.setattr(devtools.WebSocket, "open", classmethod(lambda cls, channel, path, timeout_s: Socket()))
    monkeypatch.setattr(devtools, "RETRY_S", 0.01)
    answers[:] = [not_attached, not_attached, image]
    assert devtools.capture_screenshot(lambda: contextlib.nullcontext(None)) == png
    assert len(listed) == 3 and not answers
    monkeypatch.setattr(devtools, "SETTLE_S", 0.2)
    answers[:] = [not_attached] * 1000
    with pytest.raises(devtools.DevToolsError, match="^Page.captureScreenshot: Not attached to an active page$"):
        devtools.capture_screenshot(lambda: contextlib.nullcontext(None))
    answers[:] = [json.dumps({"id": 1, "error": {"message": "no page"}}), image]
    with pytest.raises(devtools.DevToolsError, match="no page"):
        devtools.capture_screenshot(lambda: contextlib.nullcontext(None))
    assert len(answers) == 1  # asked once


def test_a_device_keeps_its_newest_screenshots_and_a_removed_one_none(cli, monkeypatch):
    """Taking a screenshot past screenshots.KEPT forgets the oldest, its row and its file; `farm
    devices remove` deletes the device's files with its rows (they grew without bound before)."""
    import contextlib

    from orchestrator.services import screenshots
    from orchestrator.transports import factory
    from orchestrator.transports.base import Screenshot

    png = bytes.fromhex("89504e470d0a1a0a0000000d49484452000000010000000108020000009077"
                        "53de0000000c4944415478da63f8cfc0000003010100c9fe92ef0000000049454e44ae426082")

    class Camera(contextlib.nullcontext):
        def screenshot(self):
            return Screenshot(png, 1, 1, "adb")

    monkeypatch.setattr(factory, "make_transport", lambda device, settings: Camera())
    monkeypatch.setattr(screenshots, "KEPT", 2)
    cli("devices", "add", "vphone-1", "--transport", "adb", "--address", "127.0.0.1:5555")
    taken = [json.loads(cli("devices", "screenshot", "vphone-1", "--json").output)["path"] for _ in range(3)]
    folder = cli.tmp / "data" / "screenshots" / "vphone-1"
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.rsplit("/", 1)[1] for p in taken[1:])
    with cli.Session() as s:
        assert store.latest_screenshot(s, store.get_device(s, "vphone-1").id).path.endswith(taken[2].rsplit("/", 1)[1])
    cli("devices", "remove", "vphone-1")
    assert not folder.exists()
