"""Beat's daily retention pass: the store's retention (orchestrator/store/retention.py) applied
with the ages the settings give (retention_*_days), in its bounded transactions, logged and
returned as a dict. Idempotent, so a redelivered or doubled pass costs only its reading."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from orchestrator.jobs.celery_app import session_for, settings_of
from orchestrator.store import retention

log = logging.getLogger(__name__)


def apply(app: Celery) -> dict[str, Any]:
    """Apply the settings' retention policy now; what it did, as Report.as_dict."""
    settings = settings_of(app)
    report = retention.apply(lambda: session_for(app), retention.Policy.of(settings), settings.data_dir)
    log.info("retention: %s", report.as_dict())
    return report.as_dict()
