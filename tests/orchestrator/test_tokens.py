"""Browser devices' page tokens are revoked at once (issue 27, item 9): `farm hub` enrols every
token file it finds, and kept serving a removed device's build files (`GET /blobs/...: 200`).
Now removing, quarantining or `farm devices revoke-token` deletes the device's token file, and
the hub, whichever process it runs in, refuses the token from its next request on."""

from __future__ import annotations

import hashlib
import http.client
import json

import pytest

from orchestrator.transports.hub import BrowserHub, read_or_make_token, revoke_token


def _get(hub: BrowserHub, path: str, token: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", hub.port, timeout=5)
    conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
    status = conn.getresponse().status
    conn.close()
    return status


def test_the_hub_refuses_a_revoked_token_from_its_next_request_on(tmp_path):
    tokens, stores = tmp_path / "tokens", tmp_path / "devices"
    token = read_or_make_token(tokens / "tab-1")
    blob = b"a build's file"
    sha = hashlib.sha256(blob).hexdigest()
    (stores / "tab-1" / "store" / sha[:2]).mkdir(parents=True)
    (stores / "tab-1" / "store" / sha[:2] / sha).write_bytes(blob)
    hub = BrowserHub("127.0.0.1", 0, tokens_dir=tokens, stores=stores, poll_s=0.2)
    try:
        assert _get(hub, f"/blobs/{sha}", token) == 200  # enrolled from its file
        assert revoke_token(tokens / "tab-1") and not revoke_token(tokens / "tab-1")
        assert _get(hub, f"/blobs/{sha}", token) == 401
        assert _get(hub, "/api/next?page=p", token) == 401
        assert not hub.status("tab-1")["registered"]
        renewed = read_or_make_token(tokens / "tab-1")  # `farm devices enrol` makes a new one
        assert renewed != token
        assert _get(hub, f"/blobs/{sha}", token) == 401 and _get(hub, f"/blobs/{sha}", renewed) == 200
    finally:
        hub.close()


@pytest.mark.parametrize("how", ["remove", "quarantine", "revoke-token"])
def test_remove_quarantine_and_revoke_token_revoke_the_page_token(cli, how):
    cli("devices", "add", "tab-1", "--transport", "web")  # prints its enrolment URL: the token is made
    path = cli.tmp / "config" / "tokens" / "browser" / "tab-1"  # Settings.browser_tokens_dir
    token = path.read_text().strip()
    args = {"remove": ["devices", "remove", "tab-1"],
            "quarantine": ["devices", "quarantine", "tab-1", "--reason", "phone lost"],
            "revoke-token": ["devices", "revoke-token", "tab-1"]}[how]
    out = cli(*args).output
    assert "revoked" in out and not path.exists(), out
    if how != "remove":
        new_url = cli("devices", "enrol", "tab-1").output
        assert path.exists() and path.read_text().strip() != token and token not in new_url


def test_revoke_token_of_a_device_without_one_is_one_error(cli):
    cli("devices", "add", "p1", "--transport", "local")
    result = cli("devices", "revoke-token", "p1", ok=False)
    assert result.exit_code == 3 and "p1 has no page token" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert json.loads(cli("devices", "list", "--json").output)[0]["serial"] == "p1"
