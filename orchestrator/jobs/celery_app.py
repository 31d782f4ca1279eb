"""The Celery application: which broker and result backend the farm uses and how tasks are
delivered. With `settings.broker_url` set (production) the broker and result backend are that
Redis; without it the embedded default needs no server: kombu's filesystem transport with
atomic message writes (orchestrator/infra/fsbroker.py) in <data_dir>/broker (polled every 0.1 s;
the measured alternatives are in
shared/notes/infra-facts.md) and a SQLite result backend next to it, with real worker
processes, never eager mode. Delivery is at-least-once (acks late, reject on worker loss,
prefetch 1), so every task re-reads the database and is idempotent (orchestrator/jobs/tasks.py).
Phones are driven by the worker on the host they are plugged into: each host consumes its own
queue, `host.<name>`, plus the shared `farm` queue for maintenance work. Notifications go to
their own queue, `notify`, consumed by a thread pool in a process of its own beside each worker
(`farm worker` starts it: orchestrator/cli/stack.py), so a receiver that answers slowly never
holds a slot a job or a deployment is waiting for.

Redis redelivers a message that was taken and not acknowledged after its visibility timeout;
here that is the longest job the farm accepts plus a margin (visibility_timeout_s), so a
running job is never delivered twice for being long, and a message held by a dead worker comes
back within that time. The embedded broker brings such a message back as soon as another
consumer sees that its owner process is gone (orchestrator/infra/fsbroker.py). Either way the store
is the truth: the reconciler (orchestrator/jobs/reconciler.py) finds work whose owner is gone long before.

A worker is started with `celery -A orchestrator.jobs.celery_app worker -Q host.<name>,farm -c N`;
`app` is built from load_settings() on first access (the worker's entry point), so importing
this module has no side effects."""

from __future__ import annotations

from functools import cache

from celery import Celery

from orchestrator.infra import fsbroker
from orchestrator.infra.settings import Settings, load_settings
from orchestrator.store import Session, SessionFactory, make_engine, make_session_factory

DEFAULT_QUEUE = "farm"
NOTIFY_QUEUE = "notify"  # notification deliveries only: their own consumer, never a job's slot
# What a job may spend beyond its time limit before its message is acked: the agent's cool-down
# wait (JobSpec.cooldown_wait_s is capped by it), deploy and fetch margins, a busy device's
# longest retry countdown (an ETA message is held unacknowledged too).
VISIBILITY_MARGIN_S = 900.0
POLLING_INTERVAL_S = 0.1
NOTIFY_SWEEP_S = 60.0  # beat resends due notification deliveries this often
SCHEDULE_TICK_S = 15.0  # beat checks the database's schedules this often (a firing is late by at most this)
RETENTION_EVERY_S = 86400.0  # beat applies the retention policy this often (orchestrator/jobs/retention.py)


def visibility_timeout_s(settings: Settings) -> float:
    """Redis delivers an unacknowledged message again after this: above the longest job."""
    return settings.max_job_time_s + VISIBILITY_MARGIN_S


def host_queue(host_name: str) -> str:
    """The queue the worker on `host_name` consumes: jobs for devices plugged into that host."""
    return f"host.{host_name}"


def worker_queues(settings: Settings) -> list[str]:
    """What a worker on this host listens to: its own host queue and the shared queue."""
    return [host_queue(settings.host_name), DEFAULT_QUEUE]


def notifier_queues() -> list[str]:
    """What a notifier (`farm notifier`, started beside each worker) listens to."""
    return [NOTIFY_QUEUE]


def _embedded_broker(settings: Settings) -> tuple[str, dict, str]:
    root = settings.broker_dir
    queue, processed, control = root / "queue", root / "processed", root / "control"
    for folder in (queue, processed, control):
        folder.mkdir(parents=True, exist_ok=True)
    options = {
        # One folder for in and out: every process on this machine sees every message.
        "data_folder_in": str(queue),
        "data_folder_out": str(queue),
        "processed_folder": str(processed),
        # Claimed messages are moved here, then deleted once decoded; undecodable ones stay
        # as <name>.bad (orchestrator/infra/fsbroker.py).
        "store_processed": False,
        "control_folder": str(control),
        "polling_interval": POLLING_INTERVAL_S,
    }
    backend = f"db+sqlite:///{settings.data_dir / 'celery-results.db'}"
    return f"{fsbroker.SCHEME}://", options, backend


def make_celery(settings: Settings) -> Celery:
    """The farm's Celery app for `settings`; `app.farm_settings` is what tasks read."""
    if settings.broker_url:
        broker, backend = settings.broker_url, settings.broker_url
        options = {"visibility_timeout": visibility_timeout_s(settings)}
    else:
        broker, options, backend = _embedded_broker(settings)
    app = Celery("devicefarm", broker=broker, backend=backend, include=["orchestrator.jobs.tasks"])
    app.conf.update(
        broker_transport_options=options,
        result_backend_transport_options={"visibility_timeout": visibility_timeout_s(settings)},
        broker_connection_retry_on_startup=True,
        task_default_queue=DEFAULT_QUEUE,
        # A retried delivery stays on its queue whoever sends it (a retry, beat's sweep, `farm notify`).
        task_routes={"orchestrator.tasks.send_notification": {"queue": NOTIFY_QUEUE}},
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_always_eager=False,
        worker_prefetch_multiplier=1,
        worker_lost_wait=2.0,  # a killed child's task is rerun after this (infra-facts.md)
        result_expires=7 * 24 * 3600,
        timezone="UTC",
        beat_schedule={
            # Whatever lost its owner (a dead worker, a lost or never-sent message) is sent again.
            "reconcile": {"task": "orchestrator.tasks.reconcile",
                          "schedule": settings.reconcile_every_s, "options": {"queue": DEFAULT_QUEUE}},
            # The farm's own schedules live in the database (`farm schedules`); beat only ticks.
            "check-schedules": {"task": "orchestrator.tasks.check_schedules",
                                "schedule": SCHEDULE_TICK_S, "options": {"queue": DEFAULT_QUEUE}},
            # Offline devices are probed again with back-off until they answer (orchestrator/jobs/health.py).
            "health-check": {"task": "orchestrator.tasks.health_check",
                             "schedule": settings.health_check_every_s, "options": {"queue": DEFAULT_QUEUE}},
            # Notification deliveries that are due and whose message was lost (orchestrator/jobs/notify.py).
            "send-due-notifications": {"task": "orchestrator.tasks.send_due_notifications",
                                       "schedule": NOTIFY_SWEEP_S, "options": {"queue": DEFAULT_QUEUE}},
            # Old runs downsampled, old images and job logs deleted (orchestrator/store/retention.py).
            "retention": {"task": "orchestrator.tasks.apply_retention",
                          "schedule": RETENTION_EVERY_S, "options": {"queue": DEFAULT_QUEUE}},
        },
    )
    app.farm_settings = settings
    return app


def settings_of(app: Celery) -> Settings:
    """The settings a farm app was made with: what every task reads."""
    settings = getattr(app, "farm_settings", None)
    if settings is None:
        raise RuntimeError("this Celery app was not made by orchestrator.jobs.celery_app.make_celery")
    return settings


@cache
def _sessions(database_url: str, idle_transaction_s: float) -> SessionFactory:
    # One engine per process (created lazily, so after the prefork fork).
    return make_session_factory(make_engine(database_url, idle_transaction_s=idle_transaction_s))


def session_for(app: Celery) -> Session:
    """A new session on the store of `app`'s settings (the process's one engine)."""
    settings = settings_of(app)
    return _sessions(settings.database_url, settings.idle_transaction_s)()


_app: Celery | None = None


def __getattr__(name: str) -> Celery:
    # `celery -A orchestrator.jobs.celery_app` looks up `app`: build it on first use only.
    global _app
    if name == "app":
        if _app is None:
            _app = make_celery(load_settings())
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
