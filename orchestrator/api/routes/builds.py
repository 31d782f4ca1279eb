"""GET /v1/builds and /v1/builds/{name}: what `farm builds list|show --json` give."""

from __future__ import annotations

from fastapi import APIRouter

from orchestrator import store
from orchestrator.store import queries

from ..deps import AUTH_ERRORS, NOT_FOUND, BuildName, Db, Reader, found
from ..schemas import BuildDetail, BuildOut

router = APIRouter(prefix="/builds", tags=["builds"], responses=AUTH_ERRORS)


@router.get("", response_model=list[BuildOut], summary="Every build, newest first")
def list_builds(_: Reader, db: Db) -> list[BuildOut]:
    return [BuildOut.of(b) for b in queries.list_builds(db)]


@router.get("/{name}", response_model=BuildDetail, responses=NOT_FOUND, summary="One build and its files")
def get_build(_: Reader, db: Db, name: BuildName) -> BuildDetail:
    return BuildDetail.of(found(store.get_build, db, name))
