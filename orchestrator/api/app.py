"""The farm API's ASGI app: `create_app(settings)` opens the store (its schema must be at head:
`farm db upgrade`), makes the Celery app checks launch their suites through, marks checks a
previous process left running as interrupted, and mounts the routes under /v1 and the dashboard's pages at /, /series/{id}, /alerts/{id}, /builds/{name} and
/devices/{serial} (their assets under /static/; the pages hold no data, their script reads /v1
with the token the user gives it). Errors are JSON
`{"detail": ...}`: 401 and 403 from the token (deps.py), 404 for an unknown record (or a
filter naming one), 400 for a check naming something unknown, 422 for a malformed request, and a value the database
refuses is a 400 rather than a server error."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from orchestrator import store
from orchestrator.dashboard import pages
from orchestrator.infra.settings import Settings
from orchestrator.store import make_engine, make_session_factory, migrate

from .check_runs import CheckRunner
from .guard import Guard
from .routes import ROUTERS

log = logging.getLogger(__name__)

API_VERSION = "1"


def create_app(settings: Settings) -> FastAPI:
    from orchestrator.jobs.celery_app import make_celery

    engine = make_engine(settings.database_url)
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
        description="Every request carries `Authorization: Bearer <token>`; tokens come from "
                    "`farm api token create --scope read|triage|run`. `read` reads everything, `triage` "
                    "also acknowledges, invalidates and fixes alerts, `run` also starts checks (not triage).",
        lifespan=lifespan,
    )
    app.state.sessions, app.state.checks, app.state.settings = sessions, checks, settings
    # outermost: tokens checked before any body is read, bodies capped, security headers (guard.py)
    app.add_middleware(Guard, sessions=sessions, max_body_bytes=settings.api_max_body_bytes,
                       body_deadline_s=settings.api_request_deadline_s)
    for router in ROUTERS:
        app.include_router(router, prefix="/v1")
    _mount_dashboard(app)

    @app.exception_handler(store.StatementError)
    async def refused_value(request: Request, exc: store.StatementError) -> JSONResponse:
        # A value the database cannot take (out of range, a character it refuses) is the
        # request's fault; anything else the database raised is a server error after all.
        said = store.refused_value(exc)
        if said is None:
            raise exc
        return JSONResponse({"detail": f"the database refused a value of the request: {said}"}, status_code=400)

    return app


DASHBOARD_ROUTES = {"/": "overview", "/series/{ident}": "series", "/alerts/{ident}": "alert",
                    "/devices/{ident}": "device", "/builds/{ident}": "gallery"}


def _mount_dashboard(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=pages.STATIC), name="static")
    for route, page in DASHBOARD_ROUTES.items():
        html = pages.render(page, live=True)

        def show(html: str = html) -> HTMLResponse:  # the page reads its id from the URL itself
            return HTMLResponse(html)

        app.add_api_route(route, show, methods=["GET"], include_in_schema=False, response_class=HTMLResponse)
