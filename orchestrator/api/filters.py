"""The filters the API's list routes share: ?device= and ?build=, by serial and build id, label or name, each
answered with 404 naming a device or build the farm does not know (deps.BAD_FILTER: an empty
list would hide a typo)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Query

from orchestrator import store

from .deps import Db, found
from .schemas import PLAIN


def device_and_build(
    db: Db,
    device: Annotated[str | None, Query(max_length=255, pattern=PLAIN, description="Device serial.")] = None,
    build: Annotated[str | None, Query(max_length=128, pattern=PLAIN, description="Build id, label or name.")] = None,
) -> tuple[int | None, int | None]:
    """The ids of the device and the build a list is filtered by (None where not given)."""
    return (found(store.get_device, db, device).id if device else None,
            found(store.get_build, db, build).id if build else None)


# A list's ?device= and ?build= filters, as (device id, build id).
DeviceAndBuild = Annotated[tuple[int | None, int | None], Depends(device_and_build)]
