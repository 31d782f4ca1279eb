"""The farm API: an ASGI app (FastAPI, served by uvicorn: `farm api serve`) over the store, with
bearer tokens that have scopes (tokens.py). Builds, devices, jobs, results, the analysis'
series, alerts and their triage, and checks started and polled; its OpenAPI at /openapi.json."""
