"""A browser device whose browser deleted the site's storage (Safari does after 7 days without a
person's visit): the page's token and the farm's key are gone with it.

- On the virtual phone's Chromium over ADB: storage cleared under a running page
  (localStorage.clear(), injected as a command into the farm's own page) is put back by the page
  from what it holds; storage deleted from the browser's profile and the page loaded again (no
  token: the hub refuses it) is enrolled again by the farm, which opens the enrolment URL over
  ADB.
- Without a browser: a page whose hello says it is not enrolled is enrolled again over ADB, a
  web device's is named with `farm devices enrol`, and a deploy refused as not-enrolled is
  retried once the page is enrolled."""

from __future__ import annotations

import shlex
import shutil
import threading
import time

import pytest
from ci_support import missing

from agent.bundle import generate_keypair
from agent.simulator import VirtualPhone
from engine.browser import find_chromium
from orchestrator.transports import DeviceOffline
from orchestrator.transports import hub as browser_hub
from orchestrator.transports.adb import AdbTransport, load_or_create_adb_key
from orchestrator.transports.browser import AdbPageLink, BrowserTransport, PageLink, WebPageLink
from orchestrator.transports.hub import AGENT_WEB_ROOT, BrowserHub

SERIAL = "sim-reenrol"


class CountingLink(AdbPageLink):
    opened: list[str]

    def open(self, url: str) -> None:
        self.opened.append(url)
        super().open(url)


@pytest.fixture
def phone_farm(tmp_path):
    if not find_chromium():
        missing("no chromium: bash scripts/ensure-chromium.sh installs it", "CI needs it")
    # The farm's own page, with one command more: the browser deleting the site's storage
    main = (AGENT_WEB_ROOT / "main.js").read_text()
    assert main.count("  ops: {\n") == 1
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "main.js").write_text(main.replace(
        "  ops: {\n", "  ops: {\n    forget: () => { localStorage.clear(); return {}; },\n"))
    saved = browser_hub._Handler.web_roots
    browser_hub._Handler.web_roots = (tmp_path / "web", *saved)
    generate_keypair(tmp_path / "farm.key", tmp_path / "farm.pub")
    hub = BrowserHub(page_lost_s=6.0, poll_s=4.0)
    key = load_or_create_adb_key(tmp_path / "keys" / "adbkey")
    try:
        with VirtualPhone(serial=SERIAL, root=tmp_path / "phone", adb_keys=key.with_name("adbkey.pub")) as phone:
            link = CountingLink(AdbTransport("127.0.0.1", phone.port, key_path=key, name=SERIAL))
            link.opened = []
            t = BrowserTransport(tmp_path / "root", link, "token-of-sim-reenrol", tmp_path / "farm.pub", name=SERIAL,
                                 hub=hub, return_timeout_s=2.0)
            try:
                yield t, link, hub, phone
            finally:
                t.close()
    finally:
        hub.close()
        browser_hub._Handler.web_roots = saved


@pytest.mark.gpu
def test_a_page_whose_storage_was_deleted_is_enrolled_again_over_adb(phone_farm):
    t, link, hub, phone = phone_farm
    hello = t.hello()
    assert (hello["device"], hello["key"], hello["restored"], len(link.opened)) == (SERIAL, True, [], 1)
    # Deleted under the running page: it puts back what it holds, nothing is opened again
    t._call("forget")
    hello = t.hello()
    assert hello["key"] and {"device", "farmKey", "token"} <= set(hello["restored"]) and len(link.opened) == 1
    # Deleted while the browser was away, then the page loaded again (as a browser restores its
    # tab): it has no token
    out, err, code = link.adb.shell("am force-stop com.android.chrome")
    assert code == 0, out + err
    shutil.rmtree(phone.apps.app_dir("com.android.chrome") / "profile" / "Default" / "Local Storage")
    out, err, code = link.adb.shell("am start -a android.intent.action.VIEW -d "
                                    f"{shlex.quote(link.origin() + '/web/index.html')} com.android.chrome")
    assert code == 0, out + err
    refused = hub.refused_tokens
    # The page asks, and the hub refuses it (401): not heard once the old page's last poll ends
    deadline = time.monotonic() + 20
    while (hub.status(SERIAL)["polling"] or hub.status(SERIAL)["seen_s_ago"] < 3.0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hub.status(SERIAL)["seen_s_ago"] >= 3.0 and hub.refused_tokens > refused
    info = t.info()  # the farm opens its enrolment URL again
    assert len(link.opened) == 2 and info.properties["engine_host"] == "browser"
    hello = t.hello()
    assert (hello["device"], hello["key"], hello["restored"]) == (SERIAL, True, [])


# ---- without a browser ---------------------------------------------------------------------------


class FakeLink(PageLink):
    def __init__(self):
        self.opened: list[str] = []

    def origin(self) -> str:
        return "http://localhost:8790"

    def prepare(self, hub) -> None:
        pass

    def open(self, url: str) -> None:
        self.opened.append(url)

    def device_info(self, adapter, user_agent=""):
        raise NotImplementedError


def _page(hub: BrowserHub, serial: str, answer, stop: threading.Event) -> threading.Thread:
    """A page that polls the hub's channel for `serial` and answers each command with answer(cmd)."""
    channel = hub.device(serial).channel

    def run():
        while not stop.is_set():
            cmd = channel.next_command("p1")
            if cmd is not None:
                channel.done({"id": cmd["id"], **answer(cmd)})

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def fake_farm(tmp_path):
    generate_keypair(tmp_path / "farm.key", tmp_path / "farm.pub")
    hub = BrowserHub(page_lost_s=6.0, poll_s=0.5)
    stop = threading.Event()
    yield hub, tmp_path, stop
    stop.set()
    hub.close()


def test_a_page_that_says_it_is_not_enrolled_is_enrolled_again_over_adb(fake_farm):
    hub, tmp, stop = fake_farm
    link = FakeLink()
    t = BrowserTransport(tmp / "root", link, "tok", tmp / "farm.pub", name="d1", hub=hub, open_timeout_s=10.0)
    hub.register("d1", "tok", tmp / "root" / "store")
    refused = []

    def answer(cmd):
        enrolled = bool(link.opened)  # its enrolment URL was opened
        if cmd["op"] == "hello":
            return {"ok": True, "result": {"adapter": {}, "device": "d1" if enrolled else "", "key": enrolled}}
        if not enrolled:
            refused.append(cmd["op"])
            return {"ok": False, "error": {"kind": "not-enrolled", "message": "this page holds no farm key"}}
        return {"ok": True, "result": {"op": cmd["op"]}}

    _page(hub, "d1", answer, stop)
    # A deploy the page refuses as not enrolled: enrolled again (its URL opened), then retried
    assert t._call("deploy", timeout_s=10)["op"] == "deploy"
    assert refused == ["deploy"] and len(link.opened) == 1
    assert link.opened[0].startswith("http://localhost:8790/web/index.html#device=d1&token=tok&key=")
    assert t.hello()["key"] is True and len(link.opened) == 1


def test_a_web_devices_page_that_lost_its_enrolment_is_named_with_the_command_to_run(fake_farm):
    hub, tmp, stop = fake_farm
    t = BrowserTransport(tmp / "root", WebPageLink("https://farm.lab:8743", "tablet-9"), "tok", tmp / "farm.pub",
                         name="tablet-9", hub=hub)
    hub.register("tablet-9", "tok", tmp / "root" / "store")
    _page(hub, "tablet-9", lambda cmd: {"ok": True, "result": {"adapter": {}, "device": "", "key": False}}, stop)
    with pytest.raises(DeviceOffline, match=r"no longer enrolled.*Safari.*`farm devices enrol tablet-9`"):
        t.hello()
