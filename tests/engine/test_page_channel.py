"""engine.pagehost.PageChannel: the one rule by which the engine's own browser and the farm's hub
send a page its commands, hear its answers and beats, and give up on a page that went away."""

from __future__ import annotations

import re
import threading
import time

import pytest

from engine.errors import BrowserError
from engine.pagehost import PageChannel


def _page(channel: PageChannel, answer, page: str = "p1", polls: int = 1):
    """A page in a thread: polls, and answers each command it takes with answer(command)."""
    def run():
        for _ in range(polls):
            command = channel.next_command(page)
            if command is not None:
                reply = answer(command)
                if reply is not None:
                    channel.done(reply)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_call_gets_the_pages_answer_and_its_errors():
    channel = PageChannel("the page", poll_s=2.0)
    _page(channel, lambda c: {"id": c["id"], "ok": True, "result": {"echo": c["x"]}})
    assert channel.call("echo", x=7, timeout_s=10) == {"echo": 7}
    _page(channel, lambda c: {"id": c["id"], "ok": False, "error": {"kind": "limit", "message": "too big"}})
    with pytest.raises(BrowserError, match="limit: too big") as err:
        channel.call("load", timeout_s=10)
    assert err.value.kind == "limit"


def test_a_page_that_goes_quiet_is_lost_long_before_the_calls_timeout():
    channel = PageChannel("the page", poll_s=0.5, lost_s=1.0)
    _page(channel, lambda c: None)  # takes the command and dies: no answer, no beat, no poll
    started = time.monotonic()
    with pytest.raises(BrowserError, match="no word from the page") as err:
        channel.call("generate", timeout_s=600)
    assert err.value.kind == "page-lost" and time.monotonic() - started < 10
    assert channel.commands.empty()  # nothing left for a later page to run


def test_beats_keep_a_page_that_runs_a_long_command():
    channel = PageChannel("the page", poll_s=0.5, lost_s=1.0)

    def slow(command):
        for _ in range(6):  # 3 s of work, a beat every 0.5 s
            time.sleep(0.5)
            channel.heard()
        return {"id": command["id"], "ok": True, "result": "done"}

    _page(channel, slow)
    assert channel.call("generate", timeout_s=30) == "done"


def test_a_timeout_says_whether_the_page_took_the_command_and_what_its_beats_said():
    """A command past its timeout says where it stood: never taken (and when the page last
    polled), or taken and what the running command's last heartbeat said it was doing."""
    channel = PageChannel("the page", poll_s=0.3, lost_s=60.0)
    channel.heard()
    with pytest.raises(BrowserError, match=r"the page never took it \(its last poll or word \d+ s ago") as err:
        channel.call("hello", timeout_s=1)
    assert err.value.kind == "timeout"

    def busy(command):  # takes the command and beats, saying where it is, but never answers
        for n in range(8):
            channel.beat({"id": command["id"], "hidden": False, "state": f"deploying b1: {n}/40 files"})
            time.sleep(0.25)

    _page(channel, busy)
    with pytest.raises(BrowserError) as err:
        channel.call("deploy", timeout_s=1.5)
    assert err.value.kind == "timeout"
    assert re.search(r"deploy: the page did not answer within 2 s: the page took it [12] s ago; its last heartbeat "
                     r"came 0 s ago and said: deploying b1: [4-7]/40 files", str(err.value)), err.value


def test_a_page_replaced_while_it_runs_a_command_is_lost():
    channel = PageChannel("the page", poll_s=0.5, lost_s=30.0)
    _page(channel, lambda c: None, page="first")
    threading.Timer(1.0, lambda: channel.next_command("second")).start()  # the tab reloaded
    with pytest.raises(BrowserError, match="replaced") as err:
        channel.call("generate", timeout_s=30)
    assert err.value.kind == "page-lost"


def test_a_browser_that_exits_ends_the_call_at_once():
    channel = PageChannel("the page", poll_s=0.5)
    with pytest.raises(BrowserError, match="the browser exited") as err:
        channel.call("hello", timeout_s=30, gone=lambda: "the browser exited with 9")
    assert err.value.kind == "browser-exited" and channel.commands.empty()


def test_a_command_that_could_not_be_delivered_goes_back_to_the_queue():
    channel = PageChannel("the page", poll_s=0.5)
    results = []
    threading.Thread(target=lambda: results.append(channel.call("hello", timeout_s=10)), daemon=True).start()
    time.sleep(0.2)
    command = channel.next_command("p1")
    channel.give_back(command)  # the page's connection broke before it got the command
    _page(channel, lambda c: {"id": c["id"], "ok": True, "result": "hi"}, page="p2")
    deadline = time.monotonic() + 10
    while not results and time.monotonic() < deadline:
        time.sleep(0.05)
    assert results == ["hi"]


def test_a_page_hidden_mid_command_ends_it_as_page_hidden_at_once():
    """A phone whose screen goes off (or whose tab goes behind another) throttles the page: it
    says so in a beat, and the command ends at once as an infrastructure failure instead of
    waiting out the page-lost silence or the call's timeout."""
    channel = PageChannel("the page", poll_s=2.0, lost_s=60.0)
    _page(channel, lambda c: channel.beat({"id": c["id"], "hidden": True}))  # takes it, then is hidden
    t0 = time.monotonic()
    with pytest.raises(BrowserError, match="hidden while it ran the command") as err:
        channel.call("generate", timeout_s=120)
    assert err.value.kind == "page-hidden" and time.monotonic() - t0 < 5
    channel.beat({"id": None, "hidden": False})  # shown again: the next command runs
    _page(channel, lambda c: {"id": c["id"], "ok": True, "result": "done"})
    assert channel.call("generate", timeout_s=10) == "done"


def test_the_hidden_beat_travels_over_http():
    import json
    import urllib.request

    from engine.browser import _Server

    server = _Server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        def poll_then_hide():
            with urllib.request.urlopen(f"{base}/api/next?session={server.session}&page=p", timeout=30) as r:
                command = json.loads(r.read())
            req = urllib.request.Request(f"{base}/api/beat?session={server.session}&page=p", method="POST",
                                         data=json.dumps({"id": command["id"], "hidden": True}).encode(),
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=10).read()

        threading.Thread(target=poll_then_hide, daemon=True).start()
        with pytest.raises(BrowserError) as err:
            server.channel.call("run", timeout_s=60)
        assert err.value.kind == "page-hidden"
    finally:
        server.shutdown()
        server.server_close()
