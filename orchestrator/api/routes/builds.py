"""GET /v1/builds and /v1/builds/{ref}: what `farm builds list|show --json` give; a build is
named by its id, its label or its full name (store.resolve_build)."""

from __future__ import annotations

from fastapi import APIRouter

from orchestrator import store
from orchestrator.store import queries

from ..deps import AUTH_ERRORS, NOT_FOUND, BuildName, Db, Reader, found
from ..schemas import BuildDetail, BuildOut

router = APIRouter(prefix="/builds", tags=["builds"], responses=AUTH_ERRORS)


@router.get("", response_model=list[BuildOut], summary="Every build, newest first")
def list_builds(_: Reader, db: Db) -> list[BuildOut]:
    builds = queries.list_builds(db)
    shown = store.build_display_names(db, [b.name for b in builds])
    return [BuildOut.of(b, shown[b.name]) for b in builds]


@router.get("/{name}", response_model=BuildDetail, responses=NOT_FOUND,
            summary="One build and its files, by id, label or name")
def get_build(_: Reader, db: Db, name: BuildName) -> BuildDetail:
    return BuildDetail.of(found(store.get_build, db, name))
