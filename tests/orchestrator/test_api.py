"""The farm API (orchestrator/api) on SQLite and PostgreSQL, over a store seeded the farm's own
way: two local devices, builds b1 and b2 at 100 ms a UNet step and b3 30 % slower, each build's
latency jobs recorded as results, and b3's batch analysed (regression alerts on both devices).

- Schemathesis generates requests from the app's own /openapi.json (every operation but
  starting a check) and checks each response: no server error, and status code, content type,
  headers and body as the schema says.
- A real uvicorn server on a free port, called with httpx for each scope: read lists and gets
  but gets 403 on a triage and on starting a check; triage acknowledges (the store's alert
  changes); run starts a check, which is refused at once (400) for an unknown device and,
  when nothing runs its jobs, ends failed with exit code 4 saying so; revoked, unknown and
  missing tokens get 401 with a WWW-Authenticate challenge; a check left running by an earlier
  process is interrupted at start-up; no token is stored in plain text.
- Every error has one shape, `{"detail": "one line", "errors": [...]}` (422s listed their
  problems in `detail` where the README promised a string), and a server fault is a 500
  without its traceback.
- `farm api token create|list|revoke` through the CLI; piped, `create` prints only the token on
  stdout (`T=$(farm api token create ...)` caught a banner line too).
- `farm api serve` and `farm dashboard serve` are one server on one default port, whose first
  line says where the dashboard, API and docs are; on a port in use they print one line and
  exit 4 (they printed the URL, then uvicorn's bind error and shutdown logs)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import numpy as np
import pytest
import schemathesis
from asgi_server import serving
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from sqlalchemy import select
from support import free_port, latency_result, seed_nightlies

from orchestrator import store
from orchestrator.api import tokens
from orchestrator.api.app import create_app
from orchestrator.infra.settings import Settings
from orchestrator.jobs import batch_analysis
from orchestrator.jobs.celery_app import make_celery
from orchestrator.store import make_engine, make_session_factory, upgrade
from orchestrator.store.models import Alert, AlertState, ApiToken, CheckRun, CheckState

SPEC = {"model": "models/tiny", "precision": "fp32", "steps": 2, "prompt": "a red bicycle", "seed": 0}


@pytest.fixture
def farm(db_url, tmp_path):
    """The seeded store, its settings, and a token of each scope plus a revoked one."""
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name="h",
                        database_url=db_url)
    upgrade(db_url)
    engine = make_engine(db_url)
    sessions = make_session_factory(engine)
    rng = np.random.default_rng(20261128)
    with sessions() as s, s.begin():
        devices = [store.upsert_device(s, serial, "local", f"/tmp/{serial}", host="h") for serial in ("p1", "p2")]
        for device in devices:
            store.set_device_state(s, device.id, "available")
        batches = seed_nightlies(s, devices, SPEC, lambda slow: latency_result(rng, slow))
        made = {scope: tokens.create_token(s, scope, f"{scope} token")[1] for scope in ("read", "triage", "run")}
        revoked_row, made["revoked"] = tokens.create_token(s, "triage", "revoked token")
        tokens.revoke_token(s, revoked_row.id)
    batch_analysis.analyze(make_celery(settings), batches["b3"])
    with sessions() as s:
        alerts = list(s.scalars(select(Alert.id).order_by(Alert.id)))
    assert len(alerts) >= 2, "b3's analysis should have raised a regression alert per device"
    yield {"settings": settings, "sessions": sessions, "tokens": made, "alerts": alerts, "url": db_url}
    engine.dispose()


# ---- the schema-driven fuzz test ----------------------------------------------------------


MAX_EXAMPLES = 15  # per operation and generation mode (valid, invalid): 30 requests an operation


def test_the_api_conforms_to_its_own_openapi(farm):
    """Requests generated from the app's own OpenAPI for every operation but starting a check
    (which launches suites on the devices: tested below), valid ones and invalid ones, with a
    triage token (it may read and triage): no 5xx, and every response conforms to the schema
    (status code, content type, headers, body)."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(farm["settings"]))
    headers = {"Authorization": f"Bearer {farm['tokens']['triage']}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    operations = [op for op in operations if (op.method.upper(), op.path) != ("POST", "/v1/checks")]
    assert len(operations) >= 18, [f"{op.method} {op.path}" for op in operations]
    calls: dict[str, int] = {}
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(operation, mode, headers, calls)
    assert len(calls) == len(operations)  # every operation was called


def _fuzz(operation, mode: GenerationMode, headers: dict[str, str], calls: dict[str, int]) -> None:
    # An invalid request may still be answered 200 here, for one reason each: a query parameter
    # the operation does not name is ignored (as HTTP APIs do), and the token header, which the
    # generated case may leave out, is the test's own.
    lenient = [schemathesis.checks.negative_data_rejection] if mode == GenerationMode.NEGATIVE else []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate], database=None)
    def call(case):
        response = case.call_and_validate(headers=headers, excluded_checks=lenient)
        label = f"{case.method} {operation.path}"
        calls[label] = calls.get(label, 0) + 1
        assert response.status_code < 500

    call()


# ---- a real server, a real client, each scope ---------------------------------------------



@pytest.fixture
def server(farm):
    """The API under uvicorn on a free port (in a thread), after an earlier process left a
    check running; yields its base URL."""
    with farm["sessions"]() as s, s.begin():
        left = CheckRun(state=CheckState.running, request={"candidate": "b3"}, progress="round 0")
        s.add(left)
        s.flush()
        farm["left_check"] = left.id
    with serving(create_app(farm["settings"])) as base:
        yield base


def _client(base: str, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=base, headers=headers, timeout=10)


def test_each_scope_does_what_it_grants_and_nothing_more(farm, server):
    alert_id = farm["alerts"][0]
    check_body = {"build": "b3", "baseline": "b2", "devices": ["p1"], "max_rounds": 0, "pairs": 1,
                  "images": False, "timeout_s": 1}
    with _client(server, farm["tokens"]["read"]) as read:
        assert read.get("/v1/me").json()["grants"] == ["read"]
        builds = read.get("/v1/builds").json()
        assert [b["name"] for b in builds] == ["b3", "b2", "b1"]
        assert read.get("/v1/builds/b1").json()["files"][0]["path"] == "models/tiny/model_index.json"
        assert {d["serial"]: d["state"] for d in read.get("/v1/devices").json()} == {"p1": "available",
                                                                                     "p2": "available"}
        jobs = read.get("/v1/jobs", params={"device": "p1", "build": "b3", "state": "succeeded"}).json()
        assert len(jobs) == 1 and jobs[0]["state"] == "succeeded"
        assert len(read.get("/v1/jobs", params={"limit": 4}).json()) == 4
        job = read.get(f"/v1/jobs/{jobs[0]['id']}").json()
        assert job["spec"]["model"] == "models/tiny" and len(job["runs"]) == 1
        assert 125 < job["runs"][0]["medians"]["unet_step_ms"] < 135  # 30 % slower than 100 ms
        run = read.get(f"/v1/results/{job['runs'][0]['run_id']}").json()
        assert {m["metric"]: m["n"] for m in run["metrics"]} == {"unet_step_ms": 10}
        assert len(read.get("/v1/results", params={"metric": "unet_step_ms"}).json()) == 6
        series = read.get("/v1/series", params={"device": "p1", "metric": "unet_step_ms"}).json()
        assert len(series) == 1 and series[0]["key"]["model"] == "models/tiny" and series[0]["runs"] == 3
        points = read.get(f"/v1/series/{series[0]['id']}").json()["points"]
        assert [p["build"] for p in points] == ["b1", "b2", "b3"]
        assert points[2]["median"] / points[1]["median"] == pytest.approx(1.3, rel=0.05)
        alerts = read.get("/v1/alerts", params={"kind": "regression"}).json()
        assert alert_id in [a["id"] for a in alerts] and all(a["state"] == "new" for a in alerts)
        assert read.get(f"/v1/alerts/{alert_id}").json()["build"] == "b3"
        # Bad input is the client's error, never the server's.
        assert read.get("/v1/jobs", params={"device": "nope"}).json() == {
            "detail": "no device 'nope'; `farm devices list` shows the known ones", "errors": []}
        assert read.get("/v1/jobs/999999").json() == {
            "detail": "no job 999999; `farm jobs list` shows the known ones", "errors": []}
        assert read.get("/v1/jobs/0").status_code == 422
        assert read.get("/v1/builds/x%00y").status_code == 422  # NUL: PostgreSQL would refuse it
        # What read may not do.
        refused = read.post(f"/v1/alerts/{alert_id}/acknowledge", json={"note": "mine"})
        assert refused.status_code == 403 and "scope (read) does not grant triage" in refused.json()["detail"]
        refused = read.post("/v1/checks", json=check_body)
        assert refused.status_code == 403 and "does not grant run" in refused.json()["detail"]
    with farm["sessions"]() as s:
        assert s.get(Alert, alert_id).state == AlertState.new  # the refusals changed nothing

    with _client(server, farm["tokens"]["triage"]) as triage:
        acked = triage.post(f"/v1/alerts/{alert_id}/acknowledge", json={"note": "on it"})
        assert acked.status_code == 200 and acked.json()["state"] == "acknowledged"
        assert triage.post(f"/v1/alerts/{farm['alerts'][1]}/invalidate").json()["state"] == "invalid"
        assert triage.post("/v1/alerts/999999/fixed").status_code == 404
        assert triage.post("/v1/checks", json=check_body).status_code == 403  # run is not triage's
    with farm["sessions"]() as s:
        alert = s.get(Alert, alert_id)
        assert (alert.state, alert.note) == (AlertState.acknowledged, "on it")
        assert s.get(Alert, farm["alerts"][1]).state == AlertState.invalid

    with _client(server, farm["tokens"]["run"]) as run_client:
        assert run_client.post(f"/v1/alerts/{alert_id}/fixed").status_code == 403  # triage is not run's
        unknown = run_client.post("/v1/checks", json=check_body | {"devices": ["nope"]})
        assert unknown.status_code == 400 and unknown.json()["detail"].startswith("no device 'nope'")
        assert run_client.post("/v1/checks", json=check_body | {"metrics": ["fps"]}).status_code == 422
        started = run_client.post("/v1/checks", json=check_body)
        assert started.status_code == 202, started.text
        check = started.json()
        assert check["state"] == "running" and check["request"]["candidate"] == "b3"
        # No worker runs this farm's jobs: the check runs out of its second and says so.
        deadline = time.monotonic() + 30
        while check["state"] == "running":
            assert time.monotonic() < deadline, check
            time.sleep(0.2)
            check = run_client.get(f"/v1/checks/{check['id']}").json()
        assert (check["state"], check["exit_code"], check["outcome"]) == ("failed", 4, "failed")
        assert "ran out of time" in check["error"] and check["started_by"] is not None
        left = run_client.get(f"/v1/checks/{farm['left_check']}").json()
        assert (left["state"], left["exit_code"]) == ("interrupted", 4) and "stopped" in left["error"]

    for token in (farm["tokens"]["revoked"], "farm_" + "x" * 43, None):
        with _client(server, token) as nobody:
            for response in (nobody.get("/v1/builds"), nobody.post(f"/v1/alerts/{alert_id}/fixed")):
                assert response.status_code == 401, (token, response.text)
                assert response.headers["www-authenticate"].startswith('Bearer realm="farm"')
                assert response.json()["detail"]
    assert httpx.get(f"{server}/openapi.json").json()["components"]["securitySchemes"]["token"]["scheme"] == "bearer"


def test_tokens_are_stored_only_as_hashes(farm, server):
    with _client(server, farm["tokens"]["read"]) as read:
        assert read.get("/v1/builds").status_code == 200
    with farm["sessions"]() as s:
        rows = list(s.scalars(select(ApiToken)))
        stored = " ".join(f"{r.name} {r.prefix} {r.sha256}" for r in rows)
        assert len(rows) == 4 and next(r for r in rows if r.scope == "read").last_used_at is not None
    for token in farm["tokens"].values():
        assert token not in stored and token[len(tokens.TOKEN_PREFIX):] not in stored
        assert tokens.digest(token) in stored
    if farm["url"].startswith("sqlite"):  # nothing anywhere in the database file holds one
        path = farm["settings"].data_dir.parent / "farm.db"
        raw = b"".join(p.read_bytes() for p in path.parent.glob("farm.db*"))
        assert raw and not any(t.encode() in raw for t in farm["tokens"].values())


# ---- the CLI ------------------------------------------------------------------------------


def test_farm_api_token_create_list_revoke(cli):
    created = cli("api", "token", "create", "--scope", "triage", "--name", "ci bot")
    token = created.stdout.strip()
    assert created.stdout == token + "\n"  # T=$(farm api token create ...) holds the token and nothing else
    assert token.startswith("farm_") and len(token) > 40 and "shown only now" in created.stderr
    listed = cli("api", "token", "list", "--json").output
    (row,) = json.loads(listed)
    assert (row["name"], row["scope"], row["prefix"], row["revoked_at"]) == ("ci bot", "triage", token[:12], None)
    assert token not in listed
    with cli.Session() as s:
        assert tokens.authenticate(s, token).scope == "triage"
    assert "revoked" in cli("api", "token", "revoke", str(row["id"])).output
    with cli.Session() as s:
        assert tokens.authenticate(s, token) is None
    again = cli("api", "token", "revoke", str(row["id"]), ok=False)
    assert again.exit_code == 3 and "revoked already" in again.output
    bad = cli("api", "token", "create", "--scope", "admin", ok=False)
    assert bad.exit_code == 3 and "unknown scope 'admin'" in bad.output
    table = cli("api", "token", "list").output
    assert "ci bot" in table and token[:12] in table and token not in table


def test_farm_api_serve_and_farm_dashboard_serve_are_one_server_on_one_port(cli, monkeypatch):
    import uvicorn

    from orchestrator.api import serving as api_serving

    served = []
    monkeypatch.setattr(uvicorn, "run", lambda api, **kw: served.append(kw))
    port = free_port()
    for command in (("api", "serve"), ("dashboard", "serve")):
        first = cli(*command, "--port", str(port)).stdout.splitlines()[0]
        base = f"http://127.0.0.1:{port}"
        assert first == f"dashboard {base}/  ·  API {base}/v1  ·  docs {base}/docs", first
    monkeypatch.setattr(api_serving, "check_listen", lambda host, port: None)  # the default may be taken here
    for command in (("api", "serve"), ("dashboard", "serve")):
        assert "http://127.0.0.1:8090/v1" in cli(*command).stdout
    assert [kw["port"] for kw in served] == [port, port, 8090, 8090]
    every = cli("api", "serve", "--host", "0.0.0.0", "--port", str(port)).stdout  # reached by the host's name
    assert f"dashboard http://testhost:{port}/" in every and served[-1]["host"] == "0.0.0.0"


def test_farm_api_serve_on_a_port_in_use_says_so_in_one_line(cli, monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda api, **kw: pytest.fail("uvicorn was started on a port in use"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for command in (("api", "serve"), ("dashboard", "serve")):
            result = cli(*command, "--port", str(port), ok=False)
            assert result.exit_code == 4, result.output  # could not run
            assert result.output.splitlines() == [
                f"error: port {port} is in use on 127.0.0.1 (another farm api serve?): pick another with --port"]


# ---- one error shape ----------------------------------------------------------------------


@pytest.fixture
def bare(tmp_path):
    """The API over an empty store, with a read and a run token."""
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name="h",
                        api_max_body_bytes=4096)
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    with make_session_factory(engine)() as s, s.begin():
        made = {scope: tokens.create_token(s, scope, scope)[1] for scope in ("read", "run")}
    engine.dispose()
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        yield client, {scope: {"Authorization": f"Bearer {t}"} for scope, t in made.items()}


def test_every_error_has_one_shape(bare, monkeypatch):
    client, auth = bare
    run, as_json = auth["run"], auth["run"] | {"Content-Type": "application/json"}
    answers = [
        (401, client.get("/v1/builds")),
        (401, client.post("/v1/checks", json={})),  # the guard's, before the body is read
        (403, client.post("/v1/alerts/1/acknowledge", headers=auth["read"])),
        (404, client.get("/v1/jobs/999", headers=run)),
        (404, client.get("/v1/no-such-route", headers=run)),  # Starlette's own
        (405, client.delete("/v1/builds", headers=run)),
        (400, client.post("/v1/checks", content=b"{not json", headers=as_json)),
        (413, client.post("/v1/checks", content=b"{}" + b" " * 8192, headers=as_json)),
        (422, client.post("/v1/checks", json={"build": "b3", "devices": "all", "max_rounds": 99, "metrics": ["fps"]},
                          headers=run)),
    ]
    monkeypatch.setattr(store, "recent_check_runs", lambda *a: (_ for _ in ()).throw(RuntimeError("secret in here")))
    answers.append((500, client.get("/v1/checks", headers=run)))
    for status, answer in answers:
        assert answer.status_code == status, (status, answer.text)
        body = answer.json()
        assert set(body) == {"detail", "errors"} and isinstance(body["errors"], list), body
        assert isinstance(body["detail"], str) and body["detail"] and "\n" not in body["detail"], body
        assert body["errors"] == [] or status == 422
    by_status = {status: answer.json() for status, answer in answers}
    assert by_status[400]["detail"].startswith("the body is not JSON")
    malformed = by_status[422]
    assert {e["field"] for e in malformed["errors"]} == {"body.max_rounds", "body.metrics.0"}, malformed
    assert malformed["detail"].startswith("body.") and malformed["detail"].endswith("(and 1 more: see errors)")
    fault = by_status[500]["detail"]
    assert "RuntimeError" in fault and "secret" not in fault and "Traceback" not in fault


def test_the_openapi_documents_the_error_shape(bare):
    client, _ = bare
    spec = client.get("/openapi.json").json()
    assert '"errors"' in spec["info"]["description"]
    malformed = spec["paths"]["/v1/checks"]["post"]["responses"]["422"]["content"]["application/json"]["schema"]
    assert malformed == {"$ref": "#/components/schemas/Problem"}
    assert set(spec["components"]["schemas"]["Problem"]["properties"]) == {"detail", "errors"}
    assert "HTTPValidationError" not in spec["components"]["schemas"]  # FastAPI's list-valued detail
