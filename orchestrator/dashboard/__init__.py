"""The farm's dashboard: static pages and a small script client (static/) that draw what the
farm API serves: an overview of devices by headline metric, each series' trend keyed as the
analysis keys it, each alert with its triage, and each device's health. `views` computes what
the pages read beyond the API's records (served under /v1 by orchestrator/api/routes/
dashboard.py); `pages` renders a page live (mounted by the API app at /, /series/{id},
/alerts/{id}, /devices/{serial}) or offline (written with its JSON by `farm dashboard build`,
orchestrator/api/offline.py)."""
