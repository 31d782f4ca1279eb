"""The farm API's ASGI app: `create_app(settings)` opens the store (its schema must be at head:
`farm db upgrade`), makes the Celery app checks launch their suites through, marks checks a
previous process left running as interrupted, and mounts the routes under /v1, the dashboard's
pages at /, /series/{id}, /alerts/{id}, /builds/{name} and /devices/{serial} (their assets under
/static/; the pages hold no data, their script reads /v1 with the token the user gives it), and
the interactive docs at /docs (Swagger UI) and /redoc, whose scripts are vendored and served
from /docs/assets/ (the farm's machines often have no internet).

Every error has one shape, `{"detail": "one line", "errors": [...]}` (schemas.Problem): 401 and
403 from the token (deps.py, guard.py), 404 for an unknown record (or a filter naming one) or
path, 400 for a body that is not JSON, a check naming something unknown or a value the database
refuses, 408 and 413 from the guard's bounds, 422 for a malformed request (`errors` names each bad
field and its problem), and 500, without a traceback, for anything unexpected (uvicorn's 503 for
too many connections is its own plain text)."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from orchestrator import store
from orchestrator.dashboard import pages
from orchestrator.infra.settings import Settings
from orchestrator.store import make_engine, make_session_factory, migrate

from .check_runs import CheckRunner
from .deps import problem
from .guard import Guard
from .routes import ROUTERS
from .schemas import FieldProblem, Problem

log = logging.getLogger(__name__)

API_VERSION = "1"
DOCS_ASSETS = Path(__file__).parent / "static" / "vendor"  # Swagger UI and ReDoc, each with its README
NO_FAVICON = "data:,"  # FastAPI's pages would fetch theirs from fastapi.tiangolo.com

DESCRIPTION = """Every request carries `Authorization: Bearer <token>`; tokens come from
`farm api token create --scope read|triage|run`. `read` reads everything, `triage` also
acknowledges, invalidates and fixes alerts, `run` also starts checks (not triage).

Every error is JSON of one shape, whatever its status:

```json
{"detail": "body.max_rounds: Input should be less than or equal to 10",
 "errors": [{"field": "body.max_rounds", "problem": "Input should be less than or equal to 10"}]}
```

`detail` is always a string; `errors` is a list, empty but for a malformed request (422),
where it names each bad field (`body.…`, `query.…`, `path.…`) and its problem. The statuses:
400 (a body that is not JSON, a check naming something unknown, a value the database refuses),
401 (no token, or an unknown or revoked one), 403 (the token's scope does not grant it), 404 (no
such record or path), 408 and 413 (a body too slow or too large), 422 (a malformed request),
500 (a fault of the server: its log has the traceback, the answer does not). Only a 503 (more
than `api_max_connections` at once) is the server's plain text, answered before the API."""


def create_app(settings: Settings) -> FastAPI:
    from orchestrator.jobs.celery_app import make_celery

    engine = make_engine(settings.database_url, idle_transaction_s=settings.idle_transaction_s)
    migrate.check(engine)  # SchemaMismatch names the fix: `farm db upgrade`
    sessions = make_session_factory(engine)
    checks = CheckRunner(sessions, make_celery(settings))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        checks.interrupt_leftovers()
        yield
        engine.dispose()

    app = FastAPI(
        title="devicefarm",
        version=API_VERSION,
        summary="The farm's builds, devices, jobs, results, series and alerts; triage; CI checks.",
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # served below from the vendored assets, not a CDN
        redoc_url=None,
    )
    app.state.sessions, app.state.checks, app.state.settings = sessions, checks, settings
    # outermost: tokens checked before any body is read, bodies capped, security headers (guard.py)
    app.add_middleware(Guard, sessions=sessions, max_body_bytes=settings.api_max_body_bytes,
                       body_deadline_s=settings.api_request_deadline_s)
    # FastAPI documents its own 422 body (`detail` a list) unless a route names one
    malformed = problem(422, "A malformed request: `errors` names each bad field and its problem.")
    for router in ROUTERS:
        app.include_router(router, prefix="/v1", responses=malformed)
    _mount_dashboard(app)
    _mount_docs(app)
    _answer_errors_in_one_shape(app)
    return app


def error(status: int, detail: str, errors: list[FieldProblem] | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    """The answer of every error (schemas.Problem)."""
    return JSONResponse(Problem(detail=detail, errors=errors or []).model_dump(), status_code=status, headers=headers)


def _answer_errors_in_one_shape(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)  # FastAPI's subclass too, and Starlette's 404 and 405
    async def refused(request: Request, exc: HTTPException) -> JSONResponse:
        return error(exc.status_code, _one_line(str(exc.detail)), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, exc: RequestValidationError) -> JSONResponse:
        found = list(exc.errors())
        for e in found:
            if e.get("type") == "json_invalid":  # as documented: a body that is not JSON is a 400
                why = (e.get("ctx") or {}).get("error", "")
                return error(400, _one_line(f"the body is not JSON: {why}".rstrip(": ")))
        errors = [FieldProblem(field=".".join(str(part) for part in e.get("loc", ())) or "request",
                               problem=_one_line(str(e.get("msg", "invalid")))) for e in found]
        if not errors:
            return error(422, "a malformed request")
        first = errors[0]
        more = f" (and {len(errors) - 1} more: see errors)" if len(errors) > 1 else ""
        return error(422, f"{first.field}: {first.problem}{more}", errors)

    @app.exception_handler(store.StatementError)
    async def refused_value(request: Request, exc: store.StatementError) -> JSONResponse:
        # A value the database cannot take (out of range, a character it refuses) is the
        # request's fault; anything else the database raised is a server error after all.
        said = store.refused_value(exc)
        if said is None:
            raise exc
        return error(400, _one_line(f"the database refused a value of the request: {said}"))

    @app.exception_handler(Exception)  # Starlette re-raises it after answering: the server logs the traceback
    async def fault(request: Request, exc: Exception) -> JSONResponse:
        return error(500, f"the server failed ({type(exc).__name__}); its log has the traceback")


def _one_line(text: str) -> str:
    return " ".join(text.split())


DASHBOARD_ROUTES = {"/": "overview", "/series/{ident}": "series", "/alerts/{ident}": "alert",
                    "/devices/{ident}": "device", "/builds/{ident}": "gallery"}


def _mount_dashboard(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=pages.STATIC), name="static")
    for route, page in DASHBOARD_ROUTES.items():
        html = pages.render(page, live=True)

        def show(html: str = html) -> HTMLResponse:  # the page reads its id from the URL itself
            return HTMLResponse(html)

        app.add_api_route(route, show, methods=["GET"], include_in_schema=False, response_class=HTMLResponse)


def _mount_docs(app: FastAPI) -> None:
    app.mount("/docs/assets", StaticFiles(directory=DOCS_ASSETS), name="docs-assets")
    title = f"{app.title} API"

    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=title,
                                   swagger_js_url="/docs/assets/swagger-ui/swagger-ui-bundle.js",
                                   swagger_css_url="/docs/assets/swagger-ui/swagger-ui.css",
                                   swagger_favicon_url=NO_FAVICON,
                                   swagger_ui_parameters={"validatorUrl": None})  # no badge from the internet

    def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=app.openapi_url, title=title,
                              redoc_js_url="/docs/assets/redoc/redoc.standalone.js",
                              redoc_favicon_url=NO_FAVICON, with_google_fonts=False)

    app.add_api_route("/docs", swagger_ui, methods=["GET"], include_in_schema=False)
    app.add_api_route("/redoc", redoc, methods=["GET"], include_in_schema=False)
