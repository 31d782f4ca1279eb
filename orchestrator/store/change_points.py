"""Change points' rows (the `change_points` table): one per series and build, found by the
analysis (orchestrator/analysis/changepoints.py) and read back by the dashboard's annotations.
Every function takes a session and flushes; the caller commits."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from .models import ChangePoint

__all__ = ["add_change_point", "change_points_of", "find_change_point"]


def add_change_point(session: Session, row: ChangePoint) -> ChangePoint:
    """Store a new change point."""
    session.add(row)
    session.flush()
    return row


def find_change_point(session: Session, series_key: str, build_id: int) -> ChangePoint | None:
    """The change point recorded at a build of the series `series_key` (canonical), or None."""
    return session.scalar(select(ChangePoint).where(ChangePoint.series_key == series_key,
                                                    ChangePoint.build_id == build_id))


def change_points_of(session: Session, series_key: str, build_ids: list[int]) -> list[ChangePoint]:
    """The change points recorded in the series `series_key` (canonical) at any of `build_ids`."""
    return list(session.scalars(select(ChangePoint).where(ChangePoint.series_key == series_key,
                                                          ChangePoint.build_id.in_(build_ids))))
