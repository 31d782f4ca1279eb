"""Notifications: what a message about an event says, and sending it to a subscription's
receiver (a signed JSON webhook, a Slack-compatible incoming webhook, or email over SMTP with
STARTTLS when offered). The store side (subscriptions, one delivery row per event and
subscription, claims) is orchestrator/store/notifications.py; the analysis and the device state
machine record events in their own transactions, and the `send_notification` task (one
delivery id, on the `notify` queue that only notifiers consume) sends each at least once: a refused or timed-out attempt is recorded and tried
again after a back-off that doubles (30 s, 1 min, ... up to an hour) until
MAX_DELIVERY_ATTEMPTS, and beat's sweep resends any delivery whose message was lost. A slow or
broken receiver costs its own task at most `notify_timeout_s` in all, however slowly it
answers, and never the analysis.

Webhook signature (docs/triage.md, "Notifications"): the subscription's secret signs, as HMAC-SHA256
over "<timestamp>.<delivery id>.<body>", `X-Farm-Signature: sha256=<hex>` beside
`X-Farm-Timestamp: <unix seconds>` and `X-Farm-Delivery: <delivery id>` (the same id on a retry,
so a receiver can drop a duplicate; signed, so no one else can make it drop one). An attempt
(connecting, sending, the whole answer) takes at most `notify_timeout_s`, reads at most 64 KiB
of the answer and follows no redirect. Webhook and Slack receivers must be at public addresses
(checked on the address connected to) unless `notify_private_targets` is set: a subscription
cannot make the workers probe the lab's own network."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client
import ipaddress
import json
import logging
import secrets
import smtplib
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from email.message import EmailMessage
from typing import Any

from celery import Celery

from orchestrator.infra import escape
from orchestrator.infra.settings import Settings
from orchestrator.jobs.celery_app import NOTIFY_QUEUE, session_for, settings_of
from orchestrator.jobs.dispatch import publish
from orchestrator.store import notifications as store
from orchestrator.store.models import Delivery, Subscription, SubscriptionKind, utcnow

log = logging.getLogger(__name__)

SEND_NOTIFICATION = "orchestrator.tasks.send_notification"
MAX_DELIVERY_ATTEMPTS = 8
BACKOFF_BASE_S, BACKOFF_MAX_S = 30.0, 3600.0
SIGNATURE_HEADER, TIMESTAMP_HEADER, DELIVERY_HEADER = "X-Farm-Signature", "X-Farm-Timestamp", "X-Farm-Delivery"


class DeliveryError(Exception):
    """The receiver refused or could not be reached; the message says how."""


def backoff_s(attempts: int) -> float:
    """The wait after the `attempts`-th refused attempt."""
    return min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (attempts - 1))


def new_secret() -> str:
    return secrets.token_hex(32)


def sign(secret: str, timestamp: str, delivery: str, body: bytes) -> str:
    """HMAC-SHA256 over "<timestamp>.<delivery>.<body>": the delivery id a receiver drops
    duplicates by is signed as well as the body."""
    message = f"{timestamp}.{delivery}.".encode() + body
    return "sha256=" + hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


# ---- what a message says ------------------------------------------------------------------


def title(event: dict[str, Any]) -> str:
    kind = event["kind"].replace("_", " ")
    if event.get("type") == "device":
        return f"[{event['severity']}] device {event['device']} quarantined"
    what = event.get("metric") or "data"
    change = "" if event.get("change_percent") is None else f" {event['change_percent']:+.1f}%"
    builds = f" ({event['build']} vs {event['baseline_build']})" if event.get("baseline_build") else ""
    return f"[{event['severity']}] {kind}: {what}{change} on {event.get('device') or 'the farm'}{builds}"


def lines(event: dict[str, Any]) -> list[str]:
    """The facts under the title: by how much (ratio, interval, medians), the build pair, why
    (a quarantine's reason), the summary, and the command that shows it."""
    out = []
    if event.get("ratio") is not None:
        interval = (f", interval {event['ci_low']:.3f}-{event['ci_high']:.3f}"
                    if event.get("ci_low") is not None and event.get("ci_high") is not None else "")
        out.append(f"ratio {event['ratio']:.3f}{interval}")
    if event.get("baseline_median") is not None and event.get("candidate_median") is not None:
        unit = f" {event['unit']}" if event.get("unit") else ""
        out.append(f"median {event['baseline_median']:.4g}{unit} -> {event['candidate_median']:.4g}{unit}")
    if event.get("build"):
        out.append(f"build {event['build']}" + (f" against baseline {event['baseline_build']}"
                                                if event.get("baseline_build") else ""))
    if event.get("reason"):
        out.append(f"reason: {event['reason']}")
    if event.get("summary"):
        out.append(event["summary"])
    out.append(f"see it: {event['command']}")
    return out


def slack_payload(event: dict[str, Any]) -> dict[str, Any]:
    """The message as Slack takes it. Its top-level text and its mrkdwn blocks are markup to
    Slack, and the facts hold what devices said (a quarantine's reason is a device's error): each
    goes through escape.slack, so a device cannot ping `<!channel>` or post a link."""
    head, facts = title(event), [escape.slack(line) for line in lines(event)]
    return {"text": escape.slack(head) + "\n" + "\n".join(facts),
            "blocks": [{"type": "header", "text": {"type": "plain_text", "text": head[:150]}},
                       {"type": "section", "text": {"type": "mrkdwn", "text": "\n".join(facts[:-1]) or escape.slack(head)}},
                       {"type": "context", "elements": [{"type": "mrkdwn",
                                                         "text": f"`{escape.slack(event['command'])}`"}]}]}


def sample_event() -> dict[str, Any]:
    """What `farm notify test` sends: an alert shaped like a real one, marked as a test."""
    return {"key": f"test:{utcnow().isoformat()}", "type": "test", "kind": "regression", "severity": "critical",
            "alert_id": 0, "device": "example-device", "metric": "unet_step_ms", "build": "candidate",
            "baseline_build": "baseline", "ratio": 1.25, "ci_low": 1.2, "ci_high": 1.3, "p_value": 0.001,
            "change_percent": 25.0, "baseline_median": 100.0, "candidate_median": 125.0, "unit": "ms",
            "series": {}, "summary": "a test notification from `farm notify test`; nothing regressed",
            "command": "farm regressions list", "created_at": utcnow().isoformat()}


# ---- sending ------------------------------------------------------------------------------


ANSWER_CAP = 64 << 10  # of a receiver's answer, at most this much is read


class _Deadline:
    """Calls the `watch`ed close (a socket's shutdown) when `seconds` have passed, so that no step
    of an attempt (connecting, sending, an answer trickled a byte at a time) outlives it;
    `expired` says whether it fired."""

    def __init__(self, seconds: float):
        self.expired, self._close = False, None
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def watch(self, close: Callable[[], None]) -> None:
        self._close = close

    def _fire(self) -> None:
        self.expired = True
        if self._close is not None:
            with contextlib.suppress(OSError):
                self._close()

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


PRIVATE_HINT = "set FARM_NOTIFY_PRIVATE_TARGETS=true (notify_private_targets) for a receiver inside the lab"


def private_address(address: str) -> bool:
    """Loopback, private, link-local, shared, reserved or unspecified: anything but a public address."""
    return not ipaddress.ip_address(address.split("%", 1)[0]).is_global


def _address(host: str, port: int, allow_private: bool) -> str:
    """The address to connect to for `host`, resolved once (so a name cannot resolve to a public
    address when checked and to an internal one when connected): refused when any address the
    name has is not public, unless private targets are allowed."""
    try:
        addresses = [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
    except OSError as exc:
        raise DeliveryError(f"cannot resolve {host}: {exc}") from None
    if not allow_private:
        private = [a for a in addresses if private_address(a)]
        if private:
            raise DeliveryError(f"{host} is {private[0]}, not a public address: the farm's workers send to public "
                                f"receivers only; {PRIVATE_HINT}")
    return addresses[0]


def _post(url: str, body: bytes, headers: dict[str, str], timeout_s: float, allow_private: bool = False) -> None:
    """One POST that takes at most `timeout_s` in all (connect, send and the whole answer), reads
    at most ANSWER_CAP of the answer, and follows no redirect (a receiver's 3xx is a refusal);
    to a public address only unless `allow_private`."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DeliveryError(f"{url}: not an http or https URL")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    port = parts.port or (443 if parts.scheme == "https" else 80)
    pinned = _address(parts.hostname, port, allow_private)
    connection = kind(parts.hostname, port, timeout=timeout_s)  # TLS checks the name; the socket goes to `pinned`
    connection._create_connection = lambda address, *args: socket.create_connection((pinned, address[1]), *args)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    with _Deadline(timeout_s) as deadline:
        deadline.watch(lambda: connection.sock is not None and connection.sock.shutdown(socket.SHUT_RDWR))
        try:
            connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **headers})
            answer = connection.getresponse()
            text = answer.read(ANSWER_CAP)
        except (OSError, http.client.HTTPException) as exc:
            if deadline.expired:
                raise DeliveryError(f"{url} gave no whole answer within {timeout_s:g} s "
                                    "(notify_timeout_s)") from None
            raise DeliveryError(f"could not reach {url}: {exc}") from None
        finally:
            connection.close()
    if 300 <= answer.status < 400:
        raise DeliveryError(f"{url} answered HTTP {answer.status} (a redirect to {answer.getheader('Location')!r}); "
                            "deliveries follow no redirect: give the final URL")
    if answer.status >= 400:
        raise DeliveryError(f"{url} answered HTTP {answer.status}: {text[:300].decode(errors='replace')}")


def email_message(settings: Settings, to: str, event: dict[str, Any]) -> EmailMessage:
    message = EmailMessage()
    message["Subject"] = escape.header(title(event))  # a device's serial or reason cannot add a header line
    message["From"] = settings.smtp_from or f"farm@{settings.host_name}"
    message["To"] = to
    message.set_content("\n".join(lines(event)) + "\n")
    return message


def _email(settings: Settings, to: str, event: dict[str, Any]) -> None:
    if not settings.smtp_host:
        raise DeliveryError("no SMTP server: set FARM_SMTP_HOST (and FARM_SMTP_PORT, FARM_SMTP_USER, ...)")
    message = email_message(settings, to, event)
    try:
        with _Deadline(settings.notify_timeout_s) as deadline, \
                smtplib.SMTP(settings.smtp_host, settings.smtp_port, timeout=settings.notify_timeout_s) as smtp:
            deadline.watch(lambda: smtp.sock is not None and smtp.sock.shutdown(socket.SHUT_RDWR))
            smtp.ehlo()
            if smtp.has_extn("starttls"):
                smtp.starttls(context=ssl.create_default_context(cafile=settings.smtp_ca_file or None))
                smtp.ehlo()
            if settings.smtp_user:
                smtp.login(settings.smtp_user, settings.smtp_password)
            smtp.send_message(message)
    except (OSError, smtplib.SMTPException) as exc:
        raise DeliveryError(f"SMTP {settings.smtp_host}:{settings.smtp_port}: {exc}") from None


def send(settings: Settings, subscription: Subscription, event: dict[str, Any], delivery_id: int = 0) -> None:
    """One attempt to tell `subscription` of `event`; DeliveryError saying why it failed."""
    timeout_s = settings.notify_timeout_s
    if subscription.kind == SubscriptionKind.email:
        _email(settings, subscription.target, event)
    elif subscription.kind == SubscriptionKind.slack:
        _post(subscription.target, json.dumps(slack_payload(event)).encode(), {}, timeout_s,
              settings.notify_private_targets)
    else:
        body = json.dumps({"delivery": delivery_id, "subscription": subscription.id, "title": title(event),
                           "event": event}, sort_keys=True).encode()
        timestamp = str(int(time.time()))
        _post(subscription.target, body, {TIMESTAMP_HEADER: timestamp, DELIVERY_HEADER: str(delivery_id),
                                          SIGNATURE_HEADER: sign(subscription.secret, timestamp, str(delivery_id), body)},
              timeout_s, settings.notify_private_targets)


def deliver(app: Celery, delivery_id: int) -> tuple[str, float | None]:
    """One attempt at a delivery: ("delivered", None), ("retry", countdown), ("failed", None),
    or ("skipped", None) when it is settled already or another sender holds it. The network
    call happens outside any transaction."""
    settings = settings_of(app)
    with session_for(app) as session, session.begin():
        delivery = store.claim(session, delivery_id, hold_s=3 * settings.notify_timeout_s + 30)
        if delivery is None:
            return "skipped", None
        subscription, event, attempts = delivery.subscription, dict(delivery.event), delivery.attempts
        session.expunge(subscription)
    try:
        send(settings, subscription, event, delivery_id)
        error = None
    except DeliveryError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001  (a receiver's fault must not kill the task's bookkeeping)
        error = f"{type(exc).__name__}: {exc}"
    retry_in = None if attempts >= MAX_DELIVERY_ATTEMPTS else backoff_s(attempts)
    with session_for(app) as session, session.begin():
        delivery = session.get(Delivery, delivery_id)
        store.settle(session, delivery, error, retry_in_s=retry_in)
    if error is None:
        return "delivered", None
    log.warning("delivery %s (attempt %s) to %s failed: %s", delivery_id, attempts, subscription.target, error)
    return ("failed", None) if retry_in is None else ("retry", retry_in)


def publish_deliveries(app: Celery, delivery_ids: list[int]) -> None:
    """Send each delivery's task (after the commit that recorded them; a lost send is the sweep's)."""
    for delivery_id in delivery_ids:
        publish(app, SEND_NOTIFICATION, (delivery_id,), NOTIFY_QUEUE)


def sweep(app: Celery) -> list[int]:
    """Beat's resend: every pending delivery that is due and unheld gets a message."""
    with session_for(app) as session:
        ids = store.due(session, utcnow())
    publish_deliveries(app, ids)
    return ids
