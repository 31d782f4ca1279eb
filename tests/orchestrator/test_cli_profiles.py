"""`farm profiles list|show|promote|diff` on each store (SQLite, then PostgreSQL), and `farm
builds create` shipping the promoted profile. The profiles are registered the way a tune
job's result registers them (orchestrator.analysis.profiles.register), from a stored tune run."""

from __future__ import annotations

import json

import pytest

from agent.protocol import Artifact, JobResult, Manifest, ManifestFile
from orchestrator import store
from orchestrator.analysis import profiles

RULES_A = [{"op": "linear", "variant": "tiled", "when": {"m": 154, "n": 768, "k": 768}},
           {"op": "attention", "variant": "flash", "when": {"dh": 40}}]
RULES_B = [{"op": "linear", "variant": "tiled", "when": {"m": 154, "n": 768, "k": 768},
            "constants": {"TILE_M": 64}},
           {"op": "conv2d", "variant": "winograd", "when": {"k": 3}}]


def _register(cli, name: str, rules: list, device: str = "phone-1", gpu: str = "Adreno (TM) 740",
              estimate: float | None = 1.3) -> int:
    """A tune job on `device` whose result brings back a profile named `name`."""
    doc = {"schema": "devicefarm.profile/1", "name": name, "priority": 100, "match": {"device": f"^{gpu}$"},
           "rules": rules, "measurements": []}
    out = cli.tmp / "results" / name
    out.mkdir(parents=True)
    (out / "profile.json").write_text(json.dumps(doc))
    with cli.Session() as s, s.begin():
        dev = store.upsert_device(s, device, "adb", f"127.0.0.1:{5555 + len(device)}", host="testhost")
        try:
            build = store.get_build(s, "b1")
        except store.StoreError:
            build = store.create_build(s, Manifest(build="b1", version="0.1.0", created=1.7e9, files=[
                ManifestFile("models/tiny/model_index.json", "b" * 64, 20)]))
        job = store.create_job(s, "tune", {"model": "models/tiny"}, dev.id, build.id)
        store.transition_job(s, job.id, "running")
        result = JobResult(job_id="x", kind="tune", status="succeeded",
                           engine={"adapter": {"vendor": "qualcomm", "device": gpu, "backend": "Vulkan",
                                               "architecture": "adreno-7xx"},
                                   "family_profile": "adreno", "estimated_gain": {"gain": estimate}},
                           artifacts=[Artifact("profile.json", "0" * 64, 10, "profile")])
        run = store.record_result(s, job.id, result, artifacts_dir=out)
        store.transition_job(s, job.id, "succeeded")
        return profiles.register(s, store.get_job(s, job.id), run, result, out).id


def _measure(cli, profile_id: int, gain: float, low: float, high: float) -> None:
    with cli.Session() as s, s.begin():
        p = s.get(profiles.Profile, profile_id)
        p.measured_gain, p.measured_gain_ci = gain, [low, high]


def test_profiles_list_show_promote_diff(cli_db):
    cli = cli_db
    assert "no tuned profiles yet" in cli("profiles", "list").output
    a = _register(cli, "tuned-adreno-740", RULES_A)
    b = _register(cli, "tuned-adreno-740-v2", RULES_B, estimate=None)
    c = _register(cli, "tuned-mali", RULES_A, device="phone-22", gpu="Mali-G715")

    rows = json.loads(cli("profiles", "list", "--json").output)
    assert [r["id"] for r in rows] == [c, b, a]
    first = rows[-1]
    assert first["gpu"]["device"] == "Adreno (TM) 740" and first["family"] == "adreno"
    assert first["tuned_on"] == "phone-1" and first["engine_version"] == "b1 (0.1.0)" and first["rules"] == 2
    assert first["estimated_gain"] == 1.3 and first["measured_gain"] is None  # never called measured
    assert [r["id"] for r in json.loads(cli("profiles", "list", "--device", "phone-22", "--json").output)] == [c]
    text = cli("profiles", "list").output
    assert "1.30x estimated from kernel times; not measured" in text and "tuned-mali" in text

    shown = cli("profiles", "show", "tuned-adreno-740").output
    assert "not measured" in shown and "attention" in shown and "flash" in shown and "adreno" in shown
    assert json.loads(cli("profiles", "show", str(a), "--json").output)["document"]["rules"] == RULES_A

    # Promotion: an unmeasured or slower profile needs --force; a measured one replaces the
    # one promoted for its GPU, and a profile of another GPU is left alone.
    result = cli("profiles", "promote", str(a), ok=False)
    assert result.exit_code == 3 and "never measured" in result.output
    _measure(cli, b, 0.8, 0.7, 0.9)
    result = cli("profiles", "promote", str(b), ok=False)
    assert result.exit_code == 3 and "measured slower" in result.output
    _measure(cli, a, 1.25, 1.1, 1.4)
    cli("profiles", "promote", str(a))
    cli("profiles", "promote", str(c), "--force")
    assert "replaces tuned-adreno-740 " in cli("profiles", "promote", str(b), "--force").output
    promoted = {r["id"]: r["promoted_at"] is not None for r in json.loads(cli("profiles", "list", "--json").output)}
    assert promoted == {a: False, b: True, c: True}
    assert "1.25x measured (95% CI 1.10-1.40)" in cli("profiles", "show", str(a)).output

    changes = json.loads(cli("profiles", "diff", str(a), str(b), "--json").output)["changes"]
    assert [(x["op"], x["a"] and x["a"]["variant"], x["b"] and x["b"]["variant"]) for x in changes] == [
        ("attention", "flash", None), ("conv2d", None, "winograd"), ("linear", "tiled", "tiled")]
    assert changes[2]["b"]["constants"] == {"TILE_M": 64}
    text = cli("profiles", "diff", str(a), str(b)).output
    assert "3 rules differ" in text and "tiled [TILE_M=64]" in text and "- (reference)" in text
    assert "choose the same kernels" in cli("profiles", "diff", str(a), str(c)).output

    for args, message in [(["show", "999"], "no profile '999'"), (["promote", "nope"], "no profile 'nope'"),
                          (["diff", str(a), "nope"], "no profile 'nope'"), (["list", "--device", "x"], "no device")]:
        result = cli("profiles", *args, ok=False)
        assert result.exit_code == 3 and message in result.output and "Traceback" not in result.output


@pytest.mark.gpu
def test_a_build_ships_the_promoted_profiles(cli, tiny_model_dir):
    a = _register(cli, "tuned-adreno-740", RULES_A)
    _register(cli, "tuned-adreno-740-v2", RULES_B)
    _measure(cli, a, 1.25, 1.1, 1.4)
    cli("profiles", "promote", str(a))
    out = cli("builds", "create", "--model", str(tiny_model_dir), "--name", "b2").output
    assert "tuned profiles shipped: tuned-adreno-740.json" in out
    shipped = cli.tmp / "data" / "builds" / "b2" / "files" / "profiles" / "tuned" / "tuned-adreno-740.json"
    with cli.Session() as s:
        assert json.loads(shipped.read_text()) == s.get(profiles.Profile, a).data
    files = json.loads(cli("builds", "show", "b2", "--json").output)["files"]
    assert [f["path"] for f in files if f["path"].startswith("profiles/tuned/")] == ["profiles/tuned/tuned-adreno-740.json"]
    cli("builds", "create", "--model", str(tiny_model_dir), "--name", "b3", "--no-tuned")
    assert not (cli.tmp / "data" / "builds" / "b3" / "files" / "profiles" / "tuned").exists()
