"""Alert groups: one regression as people triage it, every alert one build raised against one
baseline (`farm regressions list`, `group show`, `ack|invalidate|fixed --group`, `assign`).
GET /v1/alert-groups (filters and sort), /v1/alert-groups/{id}; POST /v1/alert-groups/{id}/
acknowledge, /invalidate and /fixed (the group's open alerts, or exactly the ones named, with
an optional note; 409 when none is open and none is named) and PATCH /v1/alert-groups/{id}
(owner, bug link, note) with a triage-scoped token."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query

from orchestrator import store
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
    problem,
)
from ..filters import DeviceAndBuild
from ..schemas import PLAIN, AlertGroupDetail, AlertGroupOut, GroupTriage, GroupUpdate, Metric

router = APIRouter(prefix="/alert-groups", tags=["alerts"], responses=AUTH_ERRORS)
NOT_IN_GROUP = problem(404, "No such group, or an alert named is not in it.")
NOTHING_OPEN = problem(409, "No alert of the group is open (new or acknowledged) and none is named in alert_ids.")


@router.get("", response_model=list[AlertGroupOut], responses=BAD_FILTER,
            summary="Alert groups (default: those with an open alert), newest first")
def list_groups(
    _: Reader, db: Db, filters: DeviceAndBuild,
    state: Annotated[list[AlertState] | None, Query(description="Groups with an alert in this state; repeat for "
                                                                "several; default new and acknowledged.")] = None,
    kind: Annotated[list[AlertKind] | None, Query(description="Groups with an alert of this kind.")] = None,
    metric: Annotated[Metric | None, Query(description="Groups with an alert on this metric.")] = None,
    owner: Annotated[str | None, Query(max_length=255, pattern=PLAIN,
                                       description="Groups this person owns (\"\" for unowned ones).")] = None,
    sort: Annotated[Literal["created", "worst", "size"], Query(
        description="created: newest first; worst: the worst change first; size: most alerts first.")] = "created",
    limit: Limit = 50,
) -> list[AlertGroupOut]:
    device_id, build_id = filters
    groups = store.list_alert_groups(db, states=state or store.OPEN_ALERT_STATES, kinds=kind, build_id=build_id,
                                     device_id=device_id, metric=metric, owner=owner, sort=sort, limit=limit)
    db.commit()  # alerts raised before groups existed were grouped just now
    return [AlertGroupOut.of(g) for g in groups]


@router.get("/{group_id}", response_model=AlertGroupDetail, responses=NOT_FOUND, summary="One alert group")
def get_group(_: Reader, db: Db, group_id: RecordId) -> AlertGroupDetail:
    return AlertGroupDetail.of(found(store.get_alert_group, db, group_id))


def _triage(db, group_id: int, state: AlertState, body: GroupTriage | None) -> AlertGroupDetail:
    try:
        view = store.triage_group(db, group_id, state, body.note if body else None, body.alert_ids if body else None)
    except store.InvalidTransition as exc:  # nothing open: the request is sound, the group's state refuses it
        raise HTTPException(409, str(exc)) from None
    except store.StoreError as exc:
        raise HTTPException(404, str(exc)) from None
    db.commit()
    return AlertGroupDetail.of(view)


TRIAGE_ERRORS = NOT_IN_GROUP | NOTHING_OPEN | BAD_BODY


@router.post("/{group_id}/acknowledge", response_model=AlertGroupDetail, responses=TRIAGE_ERRORS,
             summary="Acknowledge the group's open alerts (or the ones named): someone is on it")
def acknowledge(_: Triager, db: Db, group_id: RecordId, body: GroupTriage | None = None) -> AlertGroupDetail:
    return _triage(db, group_id, AlertState.acknowledged, body)


@router.post("/{group_id}/invalidate", response_model=AlertGroupDetail, responses=TRIAGE_ERRORS,
             summary="Mark the group's open alerts (or the ones named) invalid (noise, a broken device)")
def invalidate(_: Triager, db: Db, group_id: RecordId, body: GroupTriage | None = None) -> AlertGroupDetail:
    return _triage(db, group_id, AlertState.invalid, body)


@router.post("/{group_id}/fixed", response_model=AlertGroupDetail, responses=TRIAGE_ERRORS,
             summary="Mark the group's open alerts (or the ones named) fixed")
def fixed(_: Triager, db: Db, group_id: RecordId, body: GroupTriage | None = None) -> AlertGroupDetail:
    return _triage(db, group_id, AlertState.fixed, body)


@router.patch("/{group_id}", response_model=AlertGroupDetail, responses=NOT_FOUND | BAD_BODY,
              summary="Set a group's owner, bug link (http or https) or note")
def update(_: Triager, db: Db, group_id: RecordId, body: GroupUpdate) -> AlertGroupDetail:
    view = found(lambda: store.update_alert_group(db, group_id, owner=body.owner, bug_url=body.bug_url, note=body.note))
    db.commit()
    return AlertGroupDetail.of(view)
