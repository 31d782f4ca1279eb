"""GET /v1/series (the analysis' series, keyed as it keys them, each with its newest verdict)
and /v1/series/{id} (one series with a point per build): orchestrator/analysis/series.py."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from orchestrator import store
from orchestrator.analysis import series as farm_series

from ..deps import AUTH_ERRORS, BAD_FILTER, NOT_FOUND, Db, Reader, SeriesId, found
from ..schemas import PLAIN, Metric, SeriesDetail, SeriesOut, SeriesPoint, SeriesVerdict

router = APIRouter(prefix="/series", tags=["series"], responses=AUTH_ERRORS)


def _out(s: farm_series.Series) -> SeriesOut:
    return SeriesOut(id=s.id, key=s.key, canonical=s.key.canonical(), runs=s.runs,
                     latest_verdict=SeriesVerdict(**s.verdict))


@router.get("", response_model=list[SeriesOut], responses=BAD_FILTER, summary="The analysis' series")
def list_series(
    _: Reader, db: Db,
    device: Annotated[str | None, Query(max_length=255, pattern=PLAIN, description="Device serial.")] = None,
    metric: Metric | None = None,
) -> list[SeriesOut]:
    dev = found(store.get_device, db, device) if device else None
    return [_out(s) for s in farm_series.list_series(db, dev, metric)]


@router.get("/{series_id}", response_model=SeriesDetail, responses=NOT_FOUND,
            summary="One series and its points, one per build, oldest first")
def get_series(_: Reader, db: Db,
               series_id: SeriesId) -> SeriesDetail:
    found_series = found(farm_series.get_series, db, series_id)
    points = farm_series.points(db, found_series)
    shown = store.build_display_names(db, [p["build"] for p in points])
    return SeriesDetail(**_out(found_series).model_dump(),
                        points=[SeriesPoint(**p | {"display": shown[p["build"]]}) for p in points])
