"""POST /v1/checks starts a check (`farm check`, orchestrator/services/check.py) in the API process,
with a run-scoped token; GET /v1/checks and /v1/checks/{id} poll its state, progress, exit
code, outcome and report."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from orchestrator import store
from orchestrator.analysis import regressions
from orchestrator.services import check as gate

from ..deps import AUTH_ERRORS, NOT_FOUND, Db, Limit, Reader, RecordId, Runner, problem
from ..schemas import CheckIn, CheckOut

router = APIRouter(prefix="/checks", tags=["checks"], responses=AUTH_ERRORS)


@router.post("", response_model=CheckOut, status_code=202,
             responses=problem(400, "Bad input: a body that is not JSON, an unknown build or device, no device "
                                    "to run on, no baseline."),
             summary="Start a check of a candidate build against its baseline; poll GET /v1/checks/{id}")
def start_check(caller: Runner, db: Db, body: CheckIn, request: Request) -> CheckOut:
    spec = gate.latency_spec(precision=body.precision, steps=body.steps, size=body.size,
                             repetitions=body.repetitions, unet_repetitions=body.unet_repetitions,
                             timeout_s=body.timeout_s)
    wanted = gate.CheckRequest(candidate=body.build, baseline=body.baseline, devices=body.devices,
                               metrics=tuple(body.metrics or regressions.HEADLINE_METRICS), spec=spec, pairs=body.pairs,
                               max_rounds=body.max_rounds, images=body.images, timeout_s=body.timeout_s)
    try:
        row = request.app.state.checks.start(db, wanted, caller.token_id)
    except gate.CheckInput as exc:
        raise HTTPException(400, str(exc)) from None
    return CheckOut.of(row)


@router.get("", response_model=list[CheckOut], summary="Checks, newest first")
def list_checks(_: Reader, db: Db, limit: Limit = 50) -> list[CheckOut]:
    return [CheckOut.of(c) for c in store.recent_check_runs(db, limit)]


@router.get("/{check_id}", response_model=CheckOut, responses=NOT_FOUND,
            summary="One check: its state, progress and, once it ended, exit code, outcome and report")
def get_check(_: Reader, db: Db, check_id: RecordId) -> CheckOut:
    row = store.find_check_run(db, check_id)
    if row is None:
        raise HTTPException(404, f"no check {check_id}; GET /v1/checks lists them")
    return CheckOut.of(row)
