"""GET /v1/alerts (filters as `farm regressions list`), /v1/alerts/{id}, and the triage of an
alert (`farm regressions ack|invalidate|fixed`): POST /v1/alerts/{id}/acknowledge, /invalidate
and /fixed, with an optional note; a triage-scoped token."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from orchestrator import store
from orchestrator.store import queries
from orchestrator.store.models import AlertKind, AlertState

from ..deps import (
    AUTH_ERRORS,
    BAD_BODY,
    BAD_FILTER,
    NOT_FOUND,
    Db,
    Limit,
    Reader,
    RecordId,
    Triager,
    found,
)
from ..filters import DeviceAndBuild
from ..schemas import AlertOut, Triage

router = APIRouter(prefix="/alerts", tags=["alerts"], responses=AUTH_ERRORS)


@router.get("", response_model=list[AlertOut], responses=BAD_FILTER,
            summary="Alerts, newest first (default: the open ones, new and acknowledged)")
def list_alerts(
    _: Reader, db: Db, filters: DeviceAndBuild,
    state: Annotated[list[AlertState] | None, Query(description="Repeat for several; default new and "
                                                                "acknowledged.")] = None,
    kind: Annotated[list[AlertKind] | None, Query(description="Repeat for several; default every kind.")] = None,
    limit: Limit = 50,
) -> list[AlertOut]:
    device_id, build_id = filters
    alerts = queries.list_alerts(db, states=state or (AlertState.new, AlertState.acknowledged),
                                 kinds=kind or tuple(AlertKind), device_id=device_id, build_id=build_id, limit=limit)
    return [AlertOut.of(a) for a in alerts]


@router.get("/{alert_id}", response_model=AlertOut, responses=NOT_FOUND, summary="One alert")
def get_alert(_: Reader, db: Db, alert_id: RecordId) -> AlertOut:
    return AlertOut.of(found(store.get_alert, db, alert_id))


def _triage(db, alert_id: int, state: AlertState, body: Triage | None) -> AlertOut:
    alert = found(store.triage_alert, db, alert_id, state, body.note if body else None)
    db.commit()
    return AlertOut.of(alert)


@router.post("/{alert_id}/acknowledge", response_model=AlertOut, responses=NOT_FOUND | BAD_BODY,
             summary="Acknowledge an alert: someone is on it")
def acknowledge(_: Triager, db: Db, alert_id: RecordId, body: Triage | None = None) -> AlertOut:
    return _triage(db, alert_id, AlertState.acknowledged, body)


@router.post("/{alert_id}/invalidate", response_model=AlertOut, responses=NOT_FOUND | BAD_BODY,
             summary="Mark an alert invalid (noise, a broken device): its build becomes a baseline again")
def invalidate(_: Triager, db: Db, alert_id: RecordId, body: Triage | None = None) -> AlertOut:
    return _triage(db, alert_id, AlertState.invalid, body)


@router.post("/{alert_id}/fixed", response_model=AlertOut, responses=NOT_FOUND | BAD_BODY,
             summary="Mark an alert fixed")
def fixed(_: Triager, db: Db, alert_id: RecordId, body: Triage | None = None) -> AlertOut:
    return _triage(db, alert_id, AlertState.fixed, body)
