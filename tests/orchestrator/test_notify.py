"""Notifications end to end on the store (SQLite and PostgreSQL) with real local receivers: a
batch analysis that raises a regression records one delivery per matching subscription, and
the send_notification task (run eagerly, as a worker would run it) delivers it to an HTTP
receiver that checks the webhook's HMAC signature, to a Slack-format receiver and to a local
SMTP server (aiosmtpd), each exactly once even when the analysis runs twice; a receiver that
answers 500 first is retried and recorded with 2 attempts; filters keep non-matching alerts
out; a slow receiver times out and is tried again; email goes over STARTTLS with a login where
the server offers it; a quarantined device is heard of; `farm notify` adds, lists, tests and removes."""

from __future__ import annotations

import email
import email.policy
import hashlib
import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from aiosmtpd.controller import Controller
from support import RawReceiver, free_port, latency_result, seed_nightlies

from orchestrator import store
from orchestrator.infra.settings import Settings
from orchestrator.jobs import batch_analysis, notify
from orchestrator.jobs.celery_app import make_celery
from orchestrator.store import make_engine, make_session_factory, notifications, upgrade
from orchestrator.store.models import Delivery, DeliveryState, DeviceState

SPEC = {"model": "models/tiny", "precision": "fp32", "steps": 2, "prompt": "a red bicycle", "seed": 0}


class Receiver:
    """An HTTP server in a thread that records each POST and answers with `statuses` in turn
    (then 200)."""

    def __init__(self, statuses=()):
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.statuses = list(statuses)
        self.delays: list[float] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((dict(self.headers), body))
                if receiver.delays:
                    time.sleep(receiver.delays.pop(0))
                self.send_response(receiver.statuses.pop(0) if receiver.statuses else 200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Mailbox:
    async def handle_DATA(self, server, session, envelope):  # noqa: N802
        self.messages.append(envelope)
        self.tls.append(session.ssl is not None)
        return "250 OK"

    def __init__(self):
        self.messages, self.tls = [], []


@pytest.fixture
def receivers():
    made = []

    def make(statuses=()):
        made.append(Receiver(statuses))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture
def smtp():
    port = free_port()
    mailbox = Mailbox()
    controller = Controller(mailbox, hostname="127.0.0.1", port=port)
    controller.start()
    mailbox.port = port
    yield mailbox
    controller.stop()


@pytest.fixture
def farm(db_url, tmp_path, smtp):
    """Devices p1 and p2, builds b1, b2 at 100 ms and b3 30 % slower on both; a Celery app on
    the embedded broker whose SMTP server is the local one."""
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name="h",
                        database_url=db_url, smtp_host="127.0.0.1", smtp_port=smtp.port, notify_timeout_s=3,
                        notify_private_targets=True)  # the receivers listen on 127.0.0.1
    upgrade(db_url)
    engine = make_engine(db_url)
    Session = make_session_factory(engine)  # noqa: N806
    rng = np.random.default_rng(20261128)
    with Session() as s, s.begin():
        devices = [store.upsert_device(s, serial, "local", f"/tmp/{serial}", host="h") for serial in ("p1", "p2")]
        batches = seed_nightlies(s, devices, SPEC, lambda slow: latency_result(rng, slow))
    app = make_celery(settings)
    import orchestrator.jobs.tasks  # noqa: F401  (registers the tasks on the app)

    yield {"app": app, "Session": Session, "batches": batches, "settings": settings}
    engine.dispose()


def _subscribe(farm, kind, target, **filters) -> tuple[int, str]:
    with farm["Session"]() as s, s.begin():
        secret = notify.new_secret() if kind == "webhook" else ""
        return notifications.add_subscription(s, kind, target, secret=secret, **filters).id, secret


def _send_all(farm) -> list[str]:
    """Run send_notification for every pending delivery, as a worker would (retries included)."""
    task = farm["app"].tasks[notify.SEND_NOTIFICATION]
    with farm["Session"]() as s:
        ids = [d.id for d in s.query(Delivery).filter(Delivery.state == DeliveryState.pending).order_by(Delivery.id)]
    return [task.apply(args=(i,)).get() for i in ids]


def _deliveries(farm) -> list[Delivery]:
    with farm["Session"]() as s:
        rows = s.query(Delivery).order_by(Delivery.id).all()
        s.expunge_all()
        return rows


def test_a_regression_reaches_webhook_slack_and_email_exactly_once(farm, receivers, smtp):
    hook, slack = receivers(), receivers()
    hook_id, secret = _subscribe(farm, "webhook", hook.url)
    _subscribe(farm, "slack", slack.url, devices=["p1"])
    _subscribe(farm, "email", "oncall@example.com", devices=["p1"], min_severity="critical")

    for _ in range(2):  # the same batch analysed twice (a redelivered message) records nothing new
        batch_analysis.analyze(farm["app"], farm["batches"]["b3"])
    rows = _deliveries(farm)
    assert len(rows) == 4  # webhook: p1's and p2's alerts; slack and email: p1's only
    assert _send_all(farm) == ["delivered"] * 4
    assert _send_all(farm) == []  # nothing pending: never sent twice
    # ...and a task redelivered for a delivered row sends nothing.
    assert farm["app"].tasks[notify.SEND_NOTIFICATION].apply(args=(rows[0].id,)).get() == "skipped"

    assert len(hook.requests) == 2
    for headers, body in hook.requests:
        signed = f"{headers[notify.TIMESTAMP_HEADER]}.{headers[notify.DELIVERY_HEADER]}.".encode() + body
        expected = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
        assert hmac.compare_digest(headers[notify.SIGNATURE_HEADER], "sha256=" + expected)
        event = json.loads(body)["event"]
        assert event["kind"] == "regression" and event["metric"] == "unet_step_ms"
        assert (event["build"], event["baseline_build"]) == ("b3", "b2")
        assert 1.25 < event["ratio"] < 1.35 and event["ci_low"] < event["ratio"] < event["ci_high"]
        assert event["command"] == f"farm regressions show {event['alert_id']}"
        assert json.loads(body)["subscription"] == hook_id
    assert sorted(json.loads(b)["event"]["device"] for _, b in hook.requests) == ["p1", "p2"]

    (_, body), = slack.requests
    payload = json.loads(body)
    assert set(payload) == {"text", "blocks"} and "unet_step_ms +" in payload["text"]
    assert "b3 vs b2" in payload["text"] and "farm regressions show" in payload["text"]
    assert payload["blocks"][0]["type"] == "header"

    (mail,) = smtp.messages
    assert mail.rcpt_tos == ["oncall@example.com"]
    message = email.message_from_bytes(mail.content, policy=email.policy.default)
    assert message["Subject"].startswith("[critical] regression: unet_step_ms +")
    assert message["Subject"].endswith("on p1 (b3 vs b2)")
    text = message.get_content()
    assert "ratio 1.2" in text and "interval 1.2" in text and "median " in text and " ms -> " in text
    assert "build b3 against baseline b2" in text and "see it: farm regressions show" in text
    assert all(r.state == DeliveryState.delivered and r.attempts == 1 and r.delivered_at for r in _deliveries(farm))


def test_a_failing_receiver_is_retried_and_a_broken_one_never_blocks_the_analysis(farm, receivers):
    flaky = receivers(statuses=[500])
    _subscribe(farm, "webhook", flaky.url, devices=["p1"])
    _subscribe(farm, "webhook", "http://127.0.0.1:9/nothing-listens", devices=["p2"])
    batch_analysis.analyze(farm["app"], farm["batches"]["b3"])  # sends nothing itself: returns at once
    # p2's receiver is down: each retry (run at once here; a worker waits out the back-off) refused.
    assert _send_all(farm) == ["delivered", "failed"]
    first, second = _deliveries(farm)
    assert (first.state, first.attempts, first.last_error) == (DeliveryState.delivered, 2, "")
    assert len(flaky.requests) == 2
    assert flaky.requests[0][0][notify.DELIVERY_HEADER] == flaky.requests[1][0][notify.DELIVERY_HEADER]
    # The dead receiver: every attempt refused, recorded, until the attempts are spent.
    assert (second.state, second.attempts) == (DeliveryState.failed, notify.MAX_DELIVERY_ATTEMPTS)
    assert "could not reach" in second.last_error and second.delivered_at is None


def test_filters_keep_out_what_does_not_match(farm, receivers):
    hook = receivers()
    _subscribe(farm, "webhook", hook.url, devices=["p3"])
    _subscribe(farm, "webhook", hook.url, metrics=["e2e_ms"])
    _subscribe(farm, "webhook", hook.url, alert_kinds=["fidelity", "improvement"])
    batch_analysis.analyze(farm["app"], farm["batches"]["b3"])
    assert _deliveries(farm) == [] and hook.requests == []


def test_a_quarantined_device_is_heard_of_once_and_racing_records_insert_nothing(farm, receivers):
    hook = receivers()
    _subscribe(farm, "webhook", hook.url, alert_kinds=["quarantined"])
    with farm["Session"]() as s, s.begin():
        device = store.get_device(s, "p1")
        store.set_device_state(s, device.id, DeviceState.quarantined, "overheating", force=True)
        # A second reason for a device already quarantined is not a new event.
        store.set_device_state(s, device.id, DeviceState.quarantined, "still hot", force=True)
    (row,) = _deliveries(farm)
    with farm["Session"]() as s, s.begin():  # the same event recorded again (another worker): no row
        assert notifications.record_event(s, row.event) == []
    assert notify.sweep(farm["app"]) == [row.id]  # beat's sweep sends what no message carried
    assert _send_all(farm) == ["delivered"]
    (headers, body), = hook.requests
    event = json.loads(body)["event"]
    assert (event["kind"], event["device"], event["reason"]) == ("quarantined", "p1", "overheating")


def test_notify_cli_adds_lists_tests_and_removes(cli, receivers, monkeypatch):
    hook = receivers()
    for local in (hook.url, "http://localhost:9/x", "https://10.1.2.3/hook", "http://[::1]:8080/", "http://169.254.169.254/"):
        refused = cli("notify", "add", "webhook", local, ok=False)  # off by default: the lab's own network
        assert refused.exit_code == 3 and "FARM_NOTIFY_PRIVATE_TARGETS=true" in refused.output, refused.output
        assert len(refused.output.strip().splitlines()) == 1, refused.output
    monkeypatch.setenv("FARM_NOTIFY_PRIVATE_TARGETS", "true")
    out = cli("notify", "add", "webhook", hook.url, "--device", "p1", "--alert-kind", "regression").output
    assert "subscription 1" in out and "signing secret" in out
    assert cli("notify", "add", "webhook", "ftp://x", ok=False).exit_code == 3
    for header in ("ops@example.com\r\nBcc: all@example.com", "a@b.c, evil@example.com", "Ops <ops@example.com>",
                   "ops @example.com"):
        refused = cli("notify", "add", "email", header, ok=False)  # one plain address: no header line added
        assert refused.exit_code == 3 and "one plain address" in refused.output, refused.output
    assert "unknown alert kind" in cli("notify", "add", "slack", hook.url, "--alert-kind", "x", ok=False).output
    listed = json.loads(cli("notify", "list", "--json").output)
    assert listed["subscriptions"][0]["devices"] == ["p1"] and listed["deliveries"] == []
    assert "secret" not in listed["subscriptions"][0]
    cli("notify", "add", "slack", "https://hooks.slack.com/services/T000/B000/XXXXsecretXXXX")
    shown = cli("notify", "list").output + cli("notify", "list", "--json").output
    assert "XXXXsecretXXXX" not in shown and "https://hooks.slack.com/services/…" in shown
    cli("notify", "remove", "2")
    cli("notify", "test", "1")
    (headers, body), = hook.requests
    assert json.loads(body)["event"]["type"] == "test" and headers[notify.SIGNATURE_HEADER].startswith("sha256=")
    cli("notify", "remove", "1")
    assert "no subscription 1" in cli("notify", "test", "1", ok=False).output


def test_a_slow_receiver_times_out_and_is_tried_again(farm, receivers):
    slow = receivers(statuses=[200])
    slow.delays = [1.5]  # the first answer comes after the attempt gave up
    farm["app"].farm_settings = farm["settings"].model_copy(update={"notify_timeout_s": 0.5})
    _subscribe(farm, "webhook", slow.url, devices=["p1"])
    batch_analysis.analyze(farm["app"], farm["batches"]["b3"])
    assert _send_all(farm) == ["delivered"]
    (row,) = _deliveries(farm)
    assert (row.state, row.attempts) == (DeliveryState.delivered, 2)


def test_email_goes_over_starttls_with_a_login(farm, tmp_path):
    from aiosmtpd.smtp import AuthResult

    from orchestrator.infra import ca

    ca.init_ca(tmp_path / "ca")
    logins = []

    def authenticate(server, session, envelope, mechanism, auth_data):
        logins.append((auth_data.login, auth_data.password))
        return AuthResult(success=(auth_data.login, auth_data.password) == (b"farm", b"s3cret"))

    mailbox, port = Mailbox(), free_port()
    controller = Controller(mailbox, hostname="127.0.0.1", port=port,
                            tls_context=ca.server_ssl_context(tmp_path / "ca", ["127.0.0.1"]),
                            require_starttls=True, authenticator=authenticate, auth_required=True)
    controller.start()
    try:
        farm["app"].farm_settings = farm["settings"].model_copy(update={
            "smtp_port": port, "smtp_user": "farm", "smtp_password": "s3cret",
            "smtp_ca_file": str(tmp_path / "ca" / ca.CA_CERT), "smtp_from": "lab@example.com"})
        _subscribe(farm, "email", "oncall@example.com", devices=["p2"])
        batch_analysis.analyze(farm["app"], farm["batches"]["b3"])
        assert _send_all(farm) == ["delivered"]
    finally:
        controller.stop()
    (mail,) = mailbox.messages
    assert mailbox.tls == [True] and logins == [(b"farm", b"s3cret")]
    assert mail.mail_from == "lab@example.com" and mail.rcpt_tos == ["oncall@example.com"]


def test_one_attempt_takes_at_most_notify_timeout_s_however_slowly_the_receiver_answers():
    """A receiver answering a byte a second held one send for 30 s with a 2 s timeout (the
    timeout was per read): an attempt now ends at its deadline, connect to last byte."""
    def trickle(conn):
        for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100:
            conn.send(bytes([byte]))
            time.sleep(0.2)

    slow = RawReceiver(trickle)
    try:
        started = time.monotonic()
        with pytest.raises(notify.DeliveryError, match=r"no whole answer within 1 s"):
            notify._post(slow.url, b"{}", {}, 1.0, allow_private=True)
        assert time.monotonic() - started < 2.0
    finally:
        slow.close()


def test_an_endless_answer_is_read_no_further_than_its_cap():
    def endless(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
        while True:
            conn.sendall(b"y" * 65536)

    receiver = RawReceiver(endless)
    try:
        started = time.monotonic()
        notify._post(receiver.url, b"{}", {}, 5.0, allow_private=True)  # 200: delivered, after at most 64 KiB of it
        assert time.monotonic() - started < 4.0
    finally:
        receiver.close()


@pytest.mark.parametrize("status", [302, 307])
def test_a_redirect_is_not_followed(status):
    target = RawReceiver(lambda conn: conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"))
    redirect = RawReceiver(lambda conn: conn.sendall(
        f"HTTP/1.1 {status} Moved\r\nLocation: {target.url}\r\nContent-Length: 0\r\n\r\n".encode()))
    try:
        with pytest.raises(notify.DeliveryError, match=rf"HTTP {status} \(a redirect to .*\); deliveries follow no redirect"):
            notify._post(redirect.url, b"{}", {}, 5.0, allow_private=True)
        time.sleep(0.2)
        assert target.hits == 0  # urllib followed a 302 to wherever it pointed
    finally:
        redirect.close()
        target.close()


def test_a_receiver_at_a_private_address_is_refused_unless_allowed(receivers, monkeypatch):
    """A subscription pointing into the lab (loopback here; a name resolving there is the same) is
    refused where it is sent, on the address it resolved to, unless notify_private_targets is set."""
    hook = receivers()
    with pytest.raises(notify.DeliveryError, match=r"127\.0\.0\.1 is 127\.0\.0\.1, not a public address"):
        notify._post(hook.url, b"{}", {}, 5.0)
    named = hook.url.replace("127.0.0.1", "localhost")
    with pytest.raises(notify.DeliveryError, match=r"localhost is (127\.0\.0\.1|::1), not a public address"):
        notify._post(named, b"{}", {}, 5.0)
    assert hook.requests == []
    notify._post(hook.url, b"{}", {}, 5.0, allow_private=True)
    assert len(hook.requests) == 1
