"""The farm API's routes, one module per resource, each an APIRouter mounted under /v1."""

from . import alert_groups, alerts, builds, checks, dashboard, devices, jobs, me, results, series

ROUTERS = [me.router, builds.router, devices.router, jobs.router, results.router, series.router, alerts.router,
           alert_groups.router, checks.router, dashboard.router]
