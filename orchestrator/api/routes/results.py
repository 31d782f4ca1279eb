"""GET /v1/results (`farm results list --json`: one row per run, filtered) and
/v1/results/{run_id} (`farm results show --json`: one run in full)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from orchestrator.store import queries
from orchestrator.store.models import JobKind

from ..deps import AUTH_ERRORS, BAD_FILTER, NOT_FOUND, Db, Limit, Reader, RecordId, found
from ..filters import DeviceAndBuild
from ..schemas import (
    PLAIN,
    Cooldown,
    ImageOut,
    KernelTotal,
    MetricStats,
    RunDetail,
    RunSummary,
    ThermalOut,
)

router = APIRouter(prefix="/results", tags=["results"], responses=AUTH_ERRORS)


@router.get("", response_model=list[RunSummary], responses=BAD_FILTER, summary="Runs, newest first")
def list_results(
    _: Reader, db: Db, filters: DeviceAndBuild,
    metric: Annotated[str | None, Query(max_length=128, pattern=PLAIN,
                                       description="Only runs that measured this metric.")] = None,
    kind: JobKind | None = None,
    limit: Limit = 50,
) -> list[RunSummary]:
    device_id, build_id = filters
    return [RunSummary(run_id=r.id, job_id=r.job_id, attempt=r.attempt, device=r.device, build=r.build,
                       kind=r.kind, status=r.status, started_at=r.started_at, finished_at=r.finished_at,
                       medians=r.medians)
            for r in queries.list_runs(db, device_id=device_id, build_id=build_id, metric=metric, kind=kind,
                                       limit=limit)]


@router.get("/{run_id}", response_model=RunDetail, responses=NOT_FOUND,
            summary="One run: every metric, kernel times, thermal readings, images, cool-down")
def get_result(_: Reader, db: Db, run_id: RecordId) -> RunDetail:
    run = found(queries.get_run, db, run_id)
    job = run.job
    meds = queries.medians(db, [run.id], queries.KEY_METRICS)
    return RunDetail(
        run_id=run.id, job_id=run.job_id, attempt=run.attempt, device=job.device.serial,
        build=job.build.name if job.build is not None else None, kind=job.kind, status=run.status, error=run.error,
        started_at=run.started_at, finished_at=run.finished_at, medians=meds.get(run.id, {}), adapter=run.adapter,
        cooldown=Cooldown(wait_s=run.cooldown_wait_s, timed_out=run.cooldown_timed_out),
        engine=run.engine or {}, environment=run.environment or {}, env_key=run.env_key,
        metrics=[MetricStats(**m) for m in queries.metric_stats(db, run.id)],
        kernels=[KernelTotal(**k) for k in queries.kernel_totals(db, run.id)],
        thermal=[ThermalOut(phase=t.phase, zone=t.zone, celsius=t.celsius) for t in queries.thermal_readings(db, run.id)],
        images=[ImageOut(path=i.path, sha256=i.sha256, size=i.size, prompt=i.prompt, seed=i.seed)
                for i in queries.images(db, run.id)],
        artifacts=run.artifacts or [])
