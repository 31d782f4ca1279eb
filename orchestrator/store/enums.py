"""The store's enumerations: the values a column may hold (stored as VARCHAR with a CHECK
constraint, orchestrator/store/models.py), and the states of the farm's state machines."""

from __future__ import annotations

from enum import StrEnum


class TransportKind(StrEnum):
    adb = "adb"
    http = "http"
    local = "local"
    web = "web"  # a browser device that opens the farm's hub over HTTPS itself


class DeviceState(StrEnum):
    available = "available"
    busy = "busy"
    offline = "offline"
    unauthorized = "unauthorized"
    quarantined = "quarantined"


class DeploymentStatus(StrEnum):
    pending = "pending"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"


class JobKind(StrEnum):
    generate = "generate"
    latency = "latency"
    tune = "tune"


class JobState(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    infra_failed = "infra_failed"
    cancelled = "cancelled"


class AlertKind(StrEnum):
    regression = "regression"  # a metric got worse beyond its series' minimum effect
    improvement = "improvement"  # better beyond it: recorded so a baseline move is visible
    fidelity = "fidelity"  # the same seed, prompt and device gave a different image
    data_stoppage = "data_stoppage"  # a device or series stopped reporting


class AlertState(StrEnum):
    new = "new"
    acknowledged = "acknowledged"
    invalid = "invalid"
    fixed = "fixed"


class SubscriptionKind(StrEnum):
    webhook = "webhook"  # a JSON POST signed with HMAC-SHA256 (orchestrator/jobs/notify.py)
    slack = "slack"  # a Slack-compatible incoming webhook: {"text", "blocks"}
    email = "email"  # SMTP, with STARTTLS when the server offers it


class DeliveryState(StrEnum):
    pending = "pending"  # not sent yet, or sent and refused: tried again after its back-off
    delivered = "delivered"
    failed = "failed"  # refused MAX_DELIVERY_ATTEMPTS times; kept with the last error


class RunStatus(StrEnum):
    succeeded = "succeeded"
    failed = "failed"
