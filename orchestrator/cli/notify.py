"""`farm notify ...`: who hears of new alerts and quarantined devices: add, list (with the
recent deliveries and their states), remove and test a subscription (a webhook signed with
HMAC-SHA256, a Slack-compatible incoming webhook, or email over SMTP). Sending is
orchestrator/jobs/notify.py's."""

from __future__ import annotations

import contextlib
import urllib.parse
from typing import Any

import typer

from . import validate
from .common import JSON_OPTION, cli_settings, fail, get_or_fail, iso, open_store, print_json
from .output import Table, console

SUBSCRIPTION_ID = typer.Argument(..., help="Subscription id (`farm notify list`).", parser=validate.record_id)

app = typer.Typer(help="Notifications of new alerts and quarantined devices: webhook, Slack, email.",
                  no_args_is_help=True)


def shown_target(kind: str, target: str) -> str:
    """A subscription's target as listings show it: a webhook's or Slack's URL is its secret
    (whoever has a Slack incoming-webhook URL can post to the channel), so only its scheme, host
    and first path segment are shown; an email address as it is."""
    if str(kind) == "email":
        return target
    parts = urllib.parse.urlsplit(target)
    segments = [p for p in parts.path.split("/") if p]
    hidden = len(segments) > 1 or parts.query
    return f"{parts.scheme}://{parts.netloc}/{segments[0] if segments else ''}{'/…' if hidden else ''}"


def subscription_dict(s) -> dict[str, Any]:
    return {"id": s.id, "kind": str(s.kind), "target": shown_target(s.kind, s.target), "devices": s.devices, "metrics": s.metrics,
            "alert_kinds": s.alert_kinds, "severity": s.min_severity, "created_at": iso(s.created_at)}


def delivery_dict(d) -> dict[str, Any]:
    return {"id": d.id, "subscription": d.subscription_id, "event": d.event_key, "state": str(d.state),
            "attempts": d.attempts, "last_error": d.last_error or None, "delivered_at": iso(d.delivered_at),
            "next_attempt_at": iso(d.next_attempt_at), "created_at": iso(d.created_at)}


@app.command()
def add(
    kind: str = typer.Argument(..., help="webhook, slack or email."),
    target: str = typer.Argument(..., help="The webhook's URL, or the email address."),
    device: list[str] = typer.Option([], "--device", help="Only events of this device (repeatable)."),
    metric: list[str] = typer.Option([], "--metric", help="Only alerts on this metric (repeatable); "
                                     "events about a whole device (quarantined, data stoppage) still pass."),
    severity: str = typer.Option("info", "--severity", help="The least severity heard of: info (improvements), "
                                 "warning, or critical (a regression of 10 % or more, a quarantine)."),
    alert_kind: list[str] = typer.Option([], "--alert-kind", help="regression, improvement, fidelity, "
                                         "data_stoppage or quarantined (repeatable; default: all but improvement)."),
):
    """Subscribe a receiver. A webhook's signing secret is printed once, here."""
    from orchestrator.jobs import notify
    from orchestrator.store import notifications

    settings = cli_settings()
    if kind in ("webhook", "slack") and not settings.notify_private_targets:
        host = (urllib.parse.urlsplit(target).hostname or "").lower()
        literal = host == "localhost" or host.endswith(".localhost")
        with contextlib.suppress(ValueError):
            literal = literal or notify.private_address(host)
        if literal:  # a name is checked where it is sent to, on the address it resolves to then
            fail(f"{target}: {host} is not a public address; {notify.PRIVATE_HINT}")
    secret = notify.new_secret() if kind == "webhook" else ""
    with open_store(settings) as sessions, sessions() as session:
        try:
            subscription = notifications.add_subscription(
                session, kind, target, secret=secret, devices=device, metrics=metric, alert_kinds=alert_kind,
                min_severity=severity)
        except notifications.NotifyError as exc:
            fail(str(exc))
        session.commit()
        subscription_id = subscription.id
    console.print(f"subscription {subscription_id}: {kind} {target}", highlight=False, markup=False)
    if secret:
        console.print(f"signing secret (shown once; docs/triage.md, Notifications, says how to verify): {secret}",
                      highlight=False, markup=False)


@app.command("list")
def list_subscriptions(
    deliveries: int = typer.Option(10, "--deliveries", help="How many recent deliveries to show."),
    as_json: bool = JSON_OPTION,
):
    """Subscriptions, then the most recent deliveries and their states."""
    from orchestrator.store import notifications

    with open_store(cli_settings()) as sessions, sessions() as session:
        subs = [subscription_dict(s) for s in notifications.subscriptions(session)]
        recent = [delivery_dict(d) for d in notifications.recent_deliveries(session, deliveries)]
    if as_json:
        print_json({"subscriptions": subs, "deliveries": recent})
        return
    if not subs:
        console.print("no subscriptions; `farm notify add webhook URL` adds one")
    else:
        table = Table(title="subscriptions")
        for header in ("id", "kind", "target", "devices", "metrics", "kinds", "severity"):
            table.add_column(header)
        for s in subs:
            table.add_row(str(s["id"]), s["kind"], s["target"], ", ".join(s["devices"]) or "all",
                          ", ".join(s["metrics"]) or "all", ", ".join(s["alert_kinds"]) or "all but improvement",
                          f"{s['severity']}+")
        console.print(table)
    if recent:
        table = Table(title="recent deliveries")
        for header in ("id", "subscription", "event", "state", "attempts", "delivered", "last error"):
            table.add_column(header)
        for d in recent:
            table.add_row(str(d["id"]), str(d["subscription"]), d["event"], d["state"], str(d["attempts"]),
                          d["delivered_at"] or "-", d["last_error"] or "-")
        console.print(table)


@app.command()
def remove(subscription_id: int = SUBSCRIPTION_ID):
    """Remove a subscription and its deliveries."""
    from orchestrator.store import notifications

    with open_store(cli_settings()) as sessions, sessions() as session:
        try:
            session.delete(notifications.get_subscription(session, subscription_id))
        except notifications.NotifyError as exc:
            fail(str(exc))
        session.commit()
    console.print(f"removed subscription {subscription_id}")


@app.command()
def test(subscription_id: int = SUBSCRIPTION_ID):
    """Send a sample event to a subscription now (no delivery is recorded); fails saying why
    the receiver refused it."""
    from orchestrator.jobs import notify
    from orchestrator.store import notifications

    settings = cli_settings()
    with open_store(settings) as sessions, sessions() as session:
        subscription = get_or_fail(notifications.get_subscription, session, subscription_id,
                                   notifications.NotifyError)
        session.expunge(subscription)
    try:
        notify.send(settings, subscription, notify.sample_event())
    except notify.DeliveryError as exc:
        fail(f"subscription {subscription_id}: {exc}")
    console.print(f"sent a test event to subscription {subscription_id} "
                  f"({shown_target(subscription.kind, subscription.target)})",
                  highlight=False, markup=False)
