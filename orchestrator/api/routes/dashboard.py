"""What the dashboard's pages read besides the plain records (orchestrator/dashboard/views.py):
GET /v1/overview, /v1/series/{id}/events, /v1/series/{id}/kernels, /v1/alerts/{id}/context,
/v1/builds/{name}/gallery, /v1/devices/{serial}/health, and /v1/images/{id}, a generated
image's bytes (read from the farm's data directory)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from orchestrator import store
from orchestrator.analysis import series as farm_series
from orchestrator.dashboard import views

from ..deps import AUTH_ERRORS, NOT_FOUND, BuildName, Db, Reader, RecordId, Serial, SeriesId, found
from ..schemas import (
    AlertContext,
    BuildGallery,
    DeviceHealth,
    Overview,
    SeriesEvents,
    SeriesKernels,
)

router = APIRouter(tags=["dashboard"], responses=AUTH_ERRORS)


@router.get("/overview", response_model=Overview,
            summary="Every device and headline metric: each series' latest median and verdict")
def overview(_: Reader, db: Db) -> Overview:
    return Overview(**views.overview(db))


@router.get("/series/{series_id}/events", response_model=SeriesEvents, responses=NOT_FOUND,
            summary="A series' alerts, deploys, change points and environment changes")
def series_events(_: Reader, db: Db,
                  series_id: SeriesId) -> SeriesEvents:
    return SeriesEvents(**views.series_events(db, found(farm_series.get_series, db, series_id)))


@router.get("/series/{series_id}/kernels", response_model=SeriesKernels, responses=NOT_FOUND,
            summary="A series' kernels: each one's time per timed repetition, build by build")
def series_kernels(_: Reader, db: Db,
                   series_id: SeriesId) -> SeriesKernels:
    return SeriesKernels(**views.series_kernels(db, found(farm_series.get_series, db, series_id)))


@router.get("/alerts/{alert_id}/context", response_model=AlertContext, responses=NOT_FOUND,
            summary="An alert's series, its samples before and after, and the images of both builds")
def alert_context(_: Reader, db: Db, alert_id: RecordId) -> AlertContext:
    return AlertContext(**views.alert_context(db, found(store.get_alert, db, alert_id)))


@router.get("/builds/{name}/gallery", response_model=BuildGallery, responses=NOT_FOUND,
            summary="The images a build's generate jobs made, newest first")
def build_gallery(_: Reader, db: Db, name: BuildName) -> BuildGallery:
    return BuildGallery(**views.build_gallery(db, found(store.get_build, db, name)))


@router.get("/devices/{serial}/health", response_model=DeviceHealth, responses=NOT_FOUND,
            summary="A device's runs by outcome, newest runs, state and data stoppages")
def device_health(_: Reader, db: Db,
                  serial: Serial) -> DeviceHealth:
    return DeviceHealth(**views.device_health(db, found(store.get_device, db, serial)))


@router.get("/images/{image_id}", response_class=FileResponse, responses=NOT_FOUND | {
    200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}, "description": "The image."}},
    summary="A generated image's bytes")
def image(_: Reader, db: Db, request: Request, image_id: RecordId) -> FileResponse:
    path = found(views.image_file, db, image_id, request.app.state.settings.data_dir)
    return FileResponse(path)
