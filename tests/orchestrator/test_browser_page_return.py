"""A browser device's page between two tasks: each task's transport makes its own reverse
forward and ends it when the task ends, so the page is cut off from the hub in between and
comes back, by its own retries, through the next task's forward. Its last word may then be
nearly PAGE_LOST_S old: a command sent before it is back was lost as "page-lost" within a
second or two (the demo's build-B deploy to vphone-chrome-1, failed after 1.4 s), and a gap
longer than PAGE_LOST_S relaunched the browser. No Chromium here: the page is a thread that
speaks the page protocol, reachable or not as a forward would make it."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from agent.bundle import generate_keypair
from orchestrator.transports.browser import BrowserTransport, PageLink
from orchestrator.transports.hub import BrowserHub, HubClient

LOST_S = 6.0
TOKEN = "token-of-d1"


class FakePage:
    """Polls the hub while `reachable` is set (as the farm's page does through a forward),
    answering every command at once."""

    def __init__(self, hub: BrowserHub):
        self.hub = hub
        self.reachable = threading.Event()
        self.idle = threading.Event()  # not inside a request
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _request(self, path: str, body: dict | None = None):
        req = urllib.request.Request(f"{self.hub.local_url}{path}", method="POST" if body is not None else "GET",
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.reachable.is_set():
                self.idle.set()
                time.sleep(0.05)
                continue
            self.idle.clear()
            try:
                status, body = self._request("/api/next?page=p1")
                if status == 200:
                    cmd = json.loads(body)
                    self._request("/api/done?page=p1", {"id": cmd["id"], "ok": True, "result": {"op": cmd["op"]}})
            except (OSError, urllib.error.URLError):
                time.sleep(0.2)


class FakeLink(PageLink):
    """prepare(): the page is back `return_s` later (its next retry through the new forward),
    unless `dead`; open(): the browser relaunched, the page there at once."""

    def __init__(self, page: FakePage, return_s: float, dead: bool = False):
        self.page, self.return_s, self.dead = page, return_s, dead
        self.opened = 0
        self.timer: threading.Timer | None = None

    def origin(self) -> str:
        return "http://localhost:8790"

    def prepare(self, hub) -> None:
        if not self.dead and not self.page.reachable.is_set():
            self.timer = threading.Timer(self.return_s, self.page.reachable.set)
            self.timer.start()

    def open(self, url: str) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.opened += 1
        self.dead = False
        self.page.reachable.set()

    def device_info(self, adapter, user_agent=""):
        raise NotImplementedError


@pytest.fixture
def farm(tmp_path):
    hub = BrowserHub(page_lost_s=LOST_S, poll_s=2.0)
    generate_keypair(tmp_path / "farm.key", tmp_path / "farm.pub")
    page = FakePage(hub)
    yield hub, page, tmp_path
    page.stop.set()
    hub.close()


def _cut_until(page: FakePage, hub: BrowserHub, age_s: float) -> None:
    """The task's forward ends: the page is cut off; return when its last word is `age_s` old."""
    page.reachable.clear()
    assert page.idle.wait(10)
    channel = hub.device("d1").channel
    time.sleep(max(0.0, channel.seen + age_s - time.monotonic()))


@pytest.mark.parametrize("via", ["hub", "client"])
def test_a_command_waits_for_the_page_to_come_back_through_the_new_forward(farm, via):
    hub, page, tmp = farm
    front = hub if via == "hub" else HubClient(hub.local_url, hub.key)
    link = FakeLink(page, return_s=1.5)
    transport = BrowserTransport(tmp / "root", link, TOKEN, tmp / "farm.pub", name="d1", hub=front,
                                 open_timeout_s=10.0)
    assert transport._call("hello", timeout_s=20)["op"] == "hello"
    assert link.opened == 1  # the first time: opened in the browser
    # The next task starts when the page's last word is nearly LOST_S old, and the page needs
    # 1.5 s to come back: the command must not be sent (and lost) before it is.
    _cut_until(page, hub, LOST_S - 0.8)
    assert transport._call("deploy", timeout_s=20)["op"] == "deploy"
    assert link.opened == 1
    # A gap longer than LOST_S: the browser is still there, retrying; it is not relaunched.
    _cut_until(page, hub, LOST_S + 1.0)
    assert transport._call("run", timeout_s=20)["op"] == "run"
    assert link.opened == 1


def test_a_page_that_does_not_come_back_is_opened_again(farm):
    hub, page, tmp = farm
    link = FakeLink(page, return_s=1.0)
    transport = BrowserTransport(tmp / "root", link, TOKEN, tmp / "farm.pub", name="d1", hub=hub,
                                 open_timeout_s=10.0, return_timeout_s=2.0)
    transport._call("hello", timeout_s=20)
    _cut_until(page, hub, 3.0)  # not lost yet (LOST_S), but not there now either
    link.dead = True  # the tab crashed while it was cut off
    started = time.monotonic()
    assert transport._call("deploy", timeout_s=20)["op"] == "deploy"
    assert link.opened == 2 and time.monotonic() - started < 8
