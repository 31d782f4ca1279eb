"""The environment of a run in a browser's page: the browser named from real user agents
(Chrome's reduced one, headless Chromium's, Safari's, Firefox's, and browsers built on Chromium
that carry a Chrome token too), and an environment with the page's adapter and none of this
host's OS, kernel or clocks."""

from __future__ import annotations

import pytest

from agent.deviceinfo import browser_environment, parse_user_agent

USER_AGENTS = [
    # Chrome on Windows and Android: reduced to the major version (and "Android 10; K")
    ("Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/131.0.0.0 "
     "Safari/537.36", "Chrome", "131.0.0.0"),
    ("Mozilla/5.0 (Linux; Android 10; K) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/131.0.0.0 Mobile "
     "Safari/537.36", "Chrome", "131.0.0.0"),
    # Debian's headless Chromium (this suite's), and one from before the reduction
    ("Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) HeadlessChrome/156.0.0.0 "
     "Safari/537.36", "HeadlessChrome", "156.0.0.0"),
    ("Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) HeadlessChrome/91.0.4472.101 "
     "Safari/537.36", "HeadlessChrome", "91.0.4472.101"),
    # Safari on macOS and iOS: the version is Version/'s, not the WebKit build in Safari/
    ("Mozilla/5.0 (Macintosh; Intel Mac OS X 10_15_7) AppleWebKit/605.1.15 (KHTML, like Gecko) Version/26.0 "
     "Safari/605.1.15", "Safari", "26.0"),
    ("Mozilla/5.0 (iPhone; CPU iPhone OS 18_5 like Mac OS X) AppleWebKit/605.1.15 (KHTML, like Gecko) "
     "Version/18.5 Mobile/15E148 Safari/604.1", "Safari", "18.5"),
    # Firefox on Linux and Android
    ("Mozilla/5.0 (X11; Linux x86_64; rv:141.0) Gecko/20100101 Firefox/141.0", "Firefox", "141.0"),
    ("Mozilla/5.0 (Android 14; Mobile; rv:141.0) Gecko/141.0 Firefox/141.0", "Firefox", "141.0"),
    # built on Chromium: the browser's own token comes first; an Android WebView says "wv"
    ("Mozilla/5.0 (Linux; Android 14; SAMSUNG SM-S918B) AppleWebKit/537.36 (KHTML, like Gecko) "
     "SamsungBrowser/25.0 Chrome/121.0.0.0 Mobile Safari/537.36", "Samsung Internet", "25.0"),
    ("Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/131.0.0.0 "
     "Safari/537.36 Edg/131.0.0.0", "Edge", "131.0.0.0"),
    ("Mozilla/5.0 (Linux; Android 13; Pixel 7 Build/TQ3A.230901.001; wv) AppleWebKit/537.36 (KHTML, like Gecko) "
     "Version/4.0 Chrome/116.0.0.0 Mobile Safari/537.36", "Android WebView", "116.0.0.0"),
    # Chrome on iOS is WebKit: named apart from Chrome
    ("Mozilla/5.0 (iPhone; CPU iPhone OS 17_7 like Mac OS X) AppleWebKit/605.1.15 (KHTML, like Gecko) "
     "CriOS/131.0.6778.73 Mobile/15E148 Safari/604.1", "Chrome iOS", "131.0.6778.73"),
]


@pytest.mark.parametrize("user_agent,name,version", USER_AGENTS, ids=[f"{n}-{v}" for _, n, v in USER_AGENTS])
def test_the_browser_is_named_from_its_user_agent(user_agent, name, version):
    assert parse_user_agent(user_agent) == {"name": name, "version": version}


@pytest.mark.parametrize("user_agent", ["", "curl/8.5.0", "Mozilla/5.0 (compatible; MSIE 10.0)"])
def test_an_unknown_user_agent_names_nothing(user_agent):
    assert parse_user_agent(user_agent) == {}


def test_a_browser_environment_has_the_page_adapter_and_nothing_of_this_host():
    adapter = {"vendor": "qualcomm", "architecture": "adreno-7xx", "device": "adreno-7xx",
               "description": "Adreno (TM) 740", "adapter_type": "browser", "backend": "WebGPU (browser)",
               "vendor_id": 0, "device_id": 0, "features": ["shader-f16"], "limits": {"max-buffer-size": 1 << 30},
               "timestamp_period_ns": 1.0}
    env = browser_environment(adapter, USER_AGENTS[1][0])
    assert env.runtime == {"kind": "browser", "name": "Chrome", "version": "131.0.0.0"}
    assert env.driver == "Adreno (TM) 740"
    assert env.adapter == {k: adapter[k] for k in ("vendor", "architecture", "device", "backend", "adapter_type",
                                                   "vendor_id", "device_id")}
    assert (env.os, env.os_version, env.os_build, env.kernel, env.clocks_mhz) == ("", "", "", "", {})
    assert browser_environment(adapter, "curl/8.5.0").runtime == {"kind": "browser"}


@pytest.mark.parametrize("ua,expected", [
    ("Mozilla/5.0 (iPhone; CPU iPhone OS 18_6 like Mac OS X) AppleWebKit/605.1.15 (KHTML, like Gecko) "
     "Version/26.0 Mobile/15E148 Safari/604.1", ("ios", "18.6", "iPhone")),
    ("Mozilla/5.0 (iPad; CPU OS 17_4 like Mac OS X) AppleWebKit/605.1.15 (KHTML, like Gecko) Version/17.4 "
     "Mobile/15E148 Safari/604.1", ("ipados", "17.4", "iPad")),
    ("Mozilla/5.0 (Linux; Android 10; K) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/131.0.0.0 Mobile "
     "Safari/537.36", ("android", "10", "Android")),
    ("Mozilla/5.0 (Macintosh; Intel Mac OS X 10_15_7) AppleWebKit/605.1.15 (KHTML, like Gecko) Version/26.0 "
     "Safari/605.1.15", ("darwin", "10.15.7", "Mac")),
    ("Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/131.0.0.0 "
     "Safari/537.36", ("windows", "10.0", "PC")),
    ("Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) HeadlessChrome/156.0.0.0 "
     "Safari/537.36", ("linux", "", "PC")),
    ("curl/8.5.0", ("", "", "")),
])
def test_the_os_a_user_agent_claims(ua, expected):
    from agent.deviceinfo import parse_user_agent_os

    assert parse_user_agent_os(ua) == expected
