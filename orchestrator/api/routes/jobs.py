"""GET /v1/jobs (filters as `farm jobs list`), /v1/jobs/{id} (`farm jobs show --json`) and
/v1/jobs/{id}/results, the runs of one job."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from orchestrator import store
from orchestrator.store import queries
from orchestrator.store.models import JobState

from ..deps import AUTH_ERRORS, BAD_FILTER, MAX_ID, NOT_FOUND, Db, Limit, Reader, RecordId, found
from ..filters import DeviceAndBuild
from ..schemas import JobDetail, JobOut, RunSummary

router = APIRouter(prefix="/jobs", tags=["jobs"], responses=AUTH_ERRORS)


@router.get("", response_model=list[JobOut], responses=BAD_FILTER, summary="Jobs, newest first")
def list_jobs(
    _: Reader, db: Db, filters: DeviceAndBuild,
    state: JobState | None = None,
    batch: Annotated[int | None, Query(ge=1, le=MAX_ID, description="Batch id.")] = None,
    limit: Limit = 50,
) -> list[JobOut]:
    device_id, build_id = filters
    return [JobOut.of(j) for j in queries.list_jobs(db, state=state, device_id=device_id, build_id=build_id,
                                                    batch_id=batch, limit=limit)]


def job_runs(db, job) -> list[RunSummary]:
    meds = queries.medians(db, [r.id for r in job.runs], queries.KEY_METRICS)
    return [RunSummary(run_id=r.id, job_id=job.id, attempt=r.attempt, device=job.device.serial,
                       build=job.build.name if job.build is not None else None, kind=job.kind, status=r.status,
                       error=r.error, started_at=r.started_at, finished_at=r.finished_at,
                       medians=meds.get(r.id, {})) for r in job.runs]


@router.get("/{job_id}", response_model=JobDetail, responses=NOT_FOUND, summary="One job, its spec and runs")
def get_job(_: Reader, db: Db, job_id: RecordId) -> JobDetail:
    job = found(store.get_job, db, job_id)
    return JobDetail(**JobOut.of(job).model_dump(), spec=job.spec or {}, runs=job_runs(db, job))


@router.get("/{job_id}/results", response_model=list[RunSummary], responses=NOT_FOUND,
            summary="The runs of one job with the medians of their key metrics")
def job_results(_: Reader, db: Db, job_id: RecordId) -> list[RunSummary]:
    return job_runs(db, found(store.get_job, db, job_id))
