"""GET /v1/me: the token a request is made with, and what its scope grants."""

from __future__ import annotations

from fastapi import APIRouter

from ..deps import AUTH_ERRORS, Reader
from ..schemas import Me
from ..tokens import GRANTS

router = APIRouter(tags=["tokens"], responses=AUTH_ERRORS)


@router.get("/me", response_model=Me, summary="The token this request is made with")
def me(caller: Reader) -> Me:
    return Me(id=caller.token_id, name=caller.name, scope=caller.scope, grants=sorted(GRANTS[caller.scope]))
