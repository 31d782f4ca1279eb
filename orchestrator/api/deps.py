"""What every route of the farm API depends on: a store session for the request, the caller
its bearer token stands for with the scope the route needs (401 with a WWW-Authenticate header
when the token is missing, unknown or revoked; 403 when its scope does not grant the route),
and the error responses each route documents in the OpenAPI."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Path, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from orchestrator import store
from orchestrator.store.models import ApiScope

from . import tokens
from .schemas import PLAIN, Problem

bearer = HTTPBearer(auto_error=False, scheme_name="token",
                    description="A token from `farm api token create --scope read|triage|run`.")

# Ids fit every backend's integer; names and serials fit their columns, with no NUL (PostgreSQL
# refuses it in text).
MAX_ID = 2**31 - 1
RecordId = Annotated[int, Path(ge=1, le=MAX_ID)]
Limit = Annotated[int, Query(ge=1, le=500, description="At most this many, newest first.")]
BuildName = Annotated[str, Path(max_length=128, pattern=PLAIN)]
Serial = Annotated[str, Path(max_length=255, pattern=PLAIN)]
SeriesId = Annotated[str, Path(max_length=64, pattern=PLAIN)]


def problem(status: int, description: str) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": Problem, "description": description}}


AUTH_ERRORS = (problem(401, "No token, or an unknown or revoked one.")
               | problem(403, "The token's scope does not grant this."))
NOT_FOUND = problem(404, "No such record.")
BAD_BODY = problem(400, "The body is not JSON.")
# A filter naming a device or build the farm does not know is answered as the record would be:
# 404, with the same message (an empty list would hide a typo).
BAD_FILTER = problem(404, "A filter names an unknown device or build.")


def session(request: Request) -> Iterator[store.Session]:
    with request.app.state.sessions() as db:
        yield db


Db = Annotated[store.Session, Depends(session)]


# What a request without a good token is told (here and by guard.py, which answers a request
# with a body before reading it).
NO_TOKEN = "a bearer token is required: `Authorization: Bearer <token>` (`farm api token create` makes one)"
BAD_TOKEN = "unknown or revoked token"
CHALLENGE = 'Bearer realm="farm"'
BAD_TOKEN_CHALLENGE = CHALLENGE + ', error="invalid_token"'


def requires(scope: ApiScope) -> Callable[..., tokens.Caller]:
    """A dependency that lets through callers whose token grants `scope`."""

    def caller(db: Db, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> tokens.Caller:
        if credentials is None:
            raise HTTPException(401, NO_TOKEN, headers={"WWW-Authenticate": CHALLENGE})
        who = tokens.authenticate(db, credentials.credentials)
        db.commit()
        if who is None:
            raise HTTPException(401, BAD_TOKEN, headers={"WWW-Authenticate": BAD_TOKEN_CHALLENGE})
        if not who.may(scope):
            raise HTTPException(403, f"this token's scope ({who.scope}) does not grant {scope}; "
                                     f"make one with `farm api token create --scope {scope}`")
        return who

    return caller


Reader = Annotated[tokens.Caller, Depends(requires(ApiScope.read))]
Triager = Annotated[tokens.Caller, Depends(requires(ApiScope.triage))]
Runner = Annotated[tokens.Caller, Depends(requires(ApiScope.run))]


def found(lookup: Callable[..., Any], *args: Any, status: int = 404) -> Any:
    """`lookup(*args)`, a StoreError becoming an HTTP error of `status` with its message."""
    try:
        return lookup(*args)
    except store.StoreError as exc:
        raise HTTPException(status, str(exc)) from None
