"""GET /v1/devices and /v1/devices/{serial}: what `farm devices list|show --json` give, with who
holds each device (`farm devices reserve`) and its newest screenshot; GET
/v1/devices/{serial}/screenshot: that screenshot's PNG (`farm devices screenshot` takes one)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse

from orchestrator import store
from orchestrator.services.screenshots import screenshot_file
from orchestrator.store import queries

from ..deps import AUTH_ERRORS, NOT_FOUND, Db, Reader, Serial, found
from ..schemas import DeviceOut

router = APIRouter(prefix="/devices", tags=["devices"], responses=AUTH_ERRORS)


@router.get("", response_model=list[DeviceOut], summary="Every device, by serial, with its state, GPU and holder")
def list_devices(_: Reader, db: Db) -> list[DeviceOut]:
    devices = queries.list_devices(db)
    held, shots = store.active_reservations(db), store.latest_screenshots(db)
    return [DeviceOut.of(d, held.get(d.id), shots.get(d.id)) for d in devices]


@router.get("/{serial}", response_model=DeviceOut, responses=NOT_FOUND, summary="One device")
def get_device(_: Reader, db: Db, serial: Serial) -> DeviceOut:
    device = found(store.get_device, db, serial)
    return DeviceOut.of(device, store.active_reservation(db, device.id), store.latest_screenshot(db, device.id))


@router.get("/{serial}/screenshot", response_class=FileResponse, responses=NOT_FOUND | {
    200: {"content": {"image/png": {}}, "description": "The device's newest screenshot."}},
    summary="A device's newest screenshot (PNG)")
def screenshot(_: Reader, db: Db, request: Request, serial: Serial) -> FileResponse:
    device = found(store.get_device, db, serial)
    shot = store.latest_screenshot(db, device.id)
    if shot is None:
        raise HTTPException(404, f"no screenshot of {serial} yet: `farm devices screenshot {serial}` takes one")
    path = screenshot_file(request.app.state.settings, shot.path)
    if not path.is_file():
        raise HTTPException(404, f"{serial}'s newest screenshot is gone from {path}; take another")
    return FileResponse(path, media_type="image/png", headers={"Cache-Control": "no-cache"})
