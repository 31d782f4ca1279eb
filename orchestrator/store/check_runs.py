"""Checks started through the API (CheckRun) as rows: recorded, updated as they run and end,
listed, and the ones a stopped API process left running marked interrupted. What a check does
is orchestrator/services/check.py's; how the API runs one is orchestrator/api/check_runs.py's.
Every function takes a session and flushes; the caller commits."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from .models import CheckRun, CheckState, utcnow

__all__ = ["add_check_run", "find_check_run", "interrupt_running_checks", "recent_check_runs", "update_check_run"]


def add_check_run(session: Session, request: dict[str, Any], token_id: int | None) -> CheckRun:
    """A check that starts now: running, its progress "starting"."""
    row = CheckRun(state=CheckState.running, request=request, progress="starting", token_id=token_id)
    session.add(row)
    session.flush()
    return row


def update_check_run(session: Session, check_id: int, **values: Any) -> None:
    """Set columns of the check `check_id` (one UPDATE, whatever a loaded row says)."""
    session.execute(update(CheckRun).where(CheckRun.id == check_id).values(**values))
    session.flush()


def interrupt_running_checks(session: Session, *, exit_code: int, error: str) -> list[int]:
    """Every check still running ends now as interrupted, with `exit_code` and `error`; returns
    their ids."""
    return list(session.scalars(
        update(CheckRun).where(CheckRun.state == CheckState.running)
        .values(state=CheckState.interrupted, exit_code=exit_code, outcome="interrupted", error=error,
                finished_at=utcnow())
        .returning(CheckRun.id)))


def recent_check_runs(session: Session, limit: int) -> list[CheckRun]:
    """The `limit` newest checks, newest first."""
    return list(session.scalars(select(CheckRun).order_by(CheckRun.id.desc()).limit(limit)))


def find_check_run(session: Session, check_id: int) -> CheckRun | None:
    """The check `check_id`, or None."""
    return session.get(CheckRun, check_id)
