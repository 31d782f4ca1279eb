"""What leaves the farm for another renderer carries device- and pull-request-supplied strings
as text (orchestrator/infra/escape.py; issue 38, items 3 and 5): `farm check --markdown` rendered as
GitHub-flavoured Markdown (markdown-it-py, CommonMark with GFM tables), a Slack message's
mrkdwn, an email's headers."""

from __future__ import annotations

import re

from markdown_it import MarkdownIt

from orchestrator.infra import escape
from orchestrator.infra.settings import Settings
from orchestrator.jobs import notify
from orchestrator.services import check

HOSTILE = ["k`] [a](https://evil.example/a) ![x](https://evil.example/p.png) @octocat <img src=x>",
           "``double`` | [b](https://evil.example/b)", "`", " lead and trail ", "a\nb\r\n| c |", "\\|", ""]


def _render(text: str) -> str:
    return MarkdownIt("commonmark").enable("table").render(text)


def _code_texts(html: str) -> list[str]:
    return [re.sub(r"&lt;", "<", re.sub(r"&gt;", ">", re.sub(r"&quot;", '"', m).replace("&amp;", "&")))
            for m in re.findall(r"<code>(.*?)</code>", html, flags=re.S)]


def test_a_code_span_shows_any_string_as_written():
    for s in HOSTILE:
        html = _render(f"x {escape.md_code(s)} y")
        assert "<a " not in html and "<img" not in html, (s, html)
        shown = _code_texts(html)
        assert len(shown) == 1, (s, html)
        assert shown[0] == (re.sub(r"[\x00-\x1f]", " ", s) if s.strip() else " "), (s, shown, html)  # line breaks: spaces


def _report(device: str, kernel: str, candidate: str, error: str, reason: str, unit: str) -> dict:
    return {"outcome": "regression", "candidate": candidate, "baselines": {device: "b1"}, "exit_code": 1,
            "seconds": 10.0,
            "comparisons": [
                {"device": device, "metric": "unet_step_ms", "baseline_median": 10.0, "candidate_median": 20.0,
                 "unit": unit, "ratio": 2.0, "ci_low": 1.9, "ci_high": 2.1, "verdict": "regression", "rounds": 1,
                 "kernels": [{"kernel": kernel, "baseline_ms": 1.0, "candidate_ms": 5.0, "delta_ms": 4.0,
                              "share": 0.9}]},
                {"device": "d2", "metric": "e2e_ms", "verdict": "undecided", "reason": reason}],
            "fidelity": [{"device": device, "error": error}]}


def test_farm_check_markdown_carries_hostile_names_as_text_in_their_columns():
    hostile = HOSTILE[0]
    md = check.markdown(_report(device="dev|ice @team", kernel=hostile, candidate="pr`](https://evil.example)",
                                error="boom <img src=x onerror=alert(1)>\n@here", reason="[c](https://evil.example/c)",
                                unit="ms](https://evil.example)"))
    html = _render(md)
    assert "<a " not in html and "<img" not in html, html
    # every @ lies inside a code span: nothing GitHub would turn into a mention
    outside = re.sub(r"<code>.*?</code>", "", html, flags=re.S)
    assert "@" not in outside and "evil.example" not in outside, outside
    for table in re.findall(r"<table>.*?</table>", html, flags=re.S):
        header = len(re.findall(r"<th[ >]", table.split("</thead>")[0]))
        for row in re.findall(r"<tr>(.*?)</tr>", table.split("</thead>")[1], flags=re.S):
            assert len(re.findall(r"<td", row)) == header, row  # no column shifted
    rows = re.findall(r"<tr>(.*?)</tr>", html, flags=re.S)
    verdict_row = next(r for r in rows if "regression" in r and "unet_step_ms" in r)
    cells = re.findall(r"<td>(.*?)</td>", verdict_row, flags=re.S)
    assert _code_texts(cells[0]) == ["dev|ice @team"] and "<strong>regression</strong>" in cells[6], cells
    assert hostile in _code_texts(html)


def test_slack_messages_carry_a_devices_error_as_text():
    event = notify.sample_event() | {
        "type": "device", "kind": "quarantined", "device": "phone<!here>",
        "reason": "HTTP 500: <!channel> log in at <https://evil.example/login|the farm> & <@U123>"}
    payload = notify.slack_payload(event)
    mrkdwn = [payload["text"], *(b["text"]["text"] for b in payload["blocks"] if b.get("text", {}).get("type") == "mrkdwn"),
              *(e["text"] for b in payload["blocks"] for e in b.get("elements", []))]
    for text in mrkdwn:
        assert "<" not in text and ">" not in text, text
    assert "&lt;!channel&gt;" in payload["text"] and "&amp;" in payload["text"]
    assert any("&lt;https://evil.example/login|the farm&gt;" in t for t in mrkdwn)


def test_an_email_subject_is_one_line_whatever_the_device_is_called(tmp_path):
    event = notify.sample_event() | {"device": "phone\r\nBcc: everyone@example.com\nX-Evil: 1"}
    message = notify.email_message(Settings(data_dir=tmp_path, config_dir=tmp_path, host_name="h"), "ops@example.com",
                                   event)
    raw = message.as_bytes()
    headers = raw.split(b"\n\n", 1)[0]
    assert b"\nBcc:" not in headers and b"\nX-Evil:" not in headers, headers
    assert "Bcc: everyone@example.com" in message["Subject"] and message["Bcc"] is None
