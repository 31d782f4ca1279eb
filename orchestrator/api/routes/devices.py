"""GET /v1/devices and /v1/devices/{serial}: what `farm devices list|show --json` give."""

from __future__ import annotations

from fastapi import APIRouter

from orchestrator import store
from orchestrator.store import queries

from ..deps import AUTH_ERRORS, NOT_FOUND, Db, Reader, Serial, found
from ..schemas import DeviceOut

router = APIRouter(prefix="/devices", tags=["devices"], responses=AUTH_ERRORS)


@router.get("", response_model=list[DeviceOut], summary="Every device, by serial, with its state and GPU")
def list_devices(_: Reader, db: Db) -> list[DeviceOut]:
    return [DeviceOut.of(d) for d in queries.list_devices(db)]


@router.get("/{serial}", response_model=DeviceOut, responses=NOT_FOUND, summary="One device")
def get_device(_: Reader, db: Db, serial: Serial) -> DeviceOut:
    return DeviceOut.of(found(store.get_device, db, serial))
