"""`farm devices ...` and `farm builds ...` through CliRunner on a fresh SQLite store: the
listings and their --json, quarantine, the one-line error for a database not at head, a signed
build bundle the agent accepts, and discovery of a local-transport device."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.bundle import provision_public_key, verify_bundle
from orchestrator.cli import app


@pytest.fixture
def farm(tmp_path, monkeypatch):
    """Settings for a fresh farm in tmp_path (not yet migrated) and an invoke helper."""
    monkeypatch.setenv("FARM_DATABASE_URL", f"sqlite:///{tmp_path / 'farm.db'}")
    monkeypatch.setenv("FARM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FARM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("FARM_HOST_NAME", "testhost")
    runner = CliRunner()

    def invoke(*args: str, ok: bool = True):
        result = runner.invoke(app, list(args))
        if ok:
            assert result.exit_code == 0, result.output
        return result

    invoke.tmp = tmp_path
    return invoke


@pytest.fixture
def farm_db(farm):
    farm("db", "upgrade")
    return farm


def test_not_upgraded_database_is_one_clear_error(farm):
    for args in (["devices", "list"], ["builds", "list"], ["devices", "add", "p1", "--transport", "local"]):
        result = farm(*args, ok=False)
        assert result.exit_code == 4, result.output  # the store cannot be used: could not run
        assert "farm db upgrade" in result.output
        assert "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_add_list_show_remove(farm_db):
    farm = farm_db
    farm("devices", "add", "phone-1", "--transport", "adb", "--address", "127.0.0.1:5555")
    farm("devices", "add", "gpu-host", "--transport", "local", "--address", str(farm.tmp / "agent"))

    dup = farm("devices", "add", "phone-1", "--transport", "adb", ok=False)
    assert dup.exit_code == 3 and "already exists" in dup.output

    listing = json.loads(farm("devices", "list", "--json").output)
    assert [d["serial"] for d in listing] == ["gpu-host", "phone-1"]
    phone = listing[1]
    assert phone["transport"] == "adb" and phone["address"] == "127.0.0.1:5555"
    assert phone["state"] == "offline" and phone["host"] == "testhost" and phone["last_seen"] is None

    assert "phone-1" in farm("devices", "list").output
    shown = json.loads(farm("devices", "show", "phone-1", "--json").output)
    assert shown["serial"] == "phone-1" and shown["gpu"]["device"] == ""
    assert "127.0.0.1:5555" in farm("devices", "show", "phone-1").output

    farm("devices", "remove", "phone-1")
    assert [d["serial"] for d in json.loads(farm("devices", "list", "--json").output)] == ["gpu-host"]
    for args in (["devices", "show", "phone-1"], ["devices", "remove", "phone-1"]):
        missing = farm(*args, ok=False)
        assert missing.exit_code == 3 and "no device 'phone-1'" in missing.output
        assert "Traceback" not in missing.output


def test_bad_transport_is_a_usage_error(farm_db):
    result = farm_db("devices", "add", "x", "--transport", "carrier-pigeon", ok=False)
    assert result.exit_code == 3


def test_quarantine_and_release(farm_db):
    farm = farm_db
    farm("devices", "add", "phone-1", "--transport", "adb", "--address", "127.0.0.1:5555")
    not_quarantined = farm("devices", "release", "phone-1", ok=False)
    assert not_quarantined.exit_code == 3 and "not quarantined" in not_quarantined.output

    farm("devices", "quarantine", "phone-1", "--reason", "screen cracked, thermals flap")
    shown = json.loads(farm("devices", "show", "phone-1", "--json").output)
    assert shown["state"] == "quarantined" and shown["state_reason"] == "screen cracked, thermals flap"

    farm("devices", "release", "phone-1")
    shown = json.loads(farm("devices", "show", "phone-1", "--json").output)
    assert shown["state"] == "available"


def test_discover_unreachable_device_is_marked_offline(farm_db):
    farm = farm_db
    farm("devices", "add", "phone-1", "--transport", "adb", "--address", "127.0.0.1:1")
    farm("devices", "quarantine", "phone-2", "--reason", "x", ok=False)  # unknown: refused
    out = json.loads(farm("devices", "discover", "--json").output)
    assert out[0]["serial"] == "phone-1" and out[0]["state"] == "offline" and out[0]["error"]
    shown = json.loads(farm("devices", "show", "phone-1", "--json").output)
    assert shown["state"] == "offline" and shown["state_reason"]


def test_builds_create_list_show(farm_db, tiny_model_dir):
    farm = farm_db
    assert json.loads(farm("builds", "list", "--json").output) == []
    created = farm("builds", "create", "--model", str(tiny_model_dir), "--version", "1.2.3", "--name", "b1")
    assert "generated the farm signing key" in created.output and "created build" in created.output

    config = farm.tmp / "config"
    assert stat.S_IMODE((config / "farm.key").stat().st_mode) == 0o600
    bundle = farm.tmp / "data" / "builds" / "b1"
    manifest = verify_bundle(bundle, config / "farm.pub")
    paths = {f.path for f in manifest.files}
    assert "models/tiny/model_index.json" in paths
    assert "engine/__init__.py" in paths and "agent/jobs.py" in paths
    assert any(p.startswith("shaders/") and p.endswith(".wgsl") for p in paths)
    assert not any("__pycache__" in p for p in paths)
    assert "engine/web/plan.js" in paths  # the browser executor travels with every build
    assert not any(p.startswith("agent/simulator/") for p in paths)  # the virtual phone never does
    assert [p for p in (farm.tmp / "data" / "builds").iterdir()] == [bundle]  # no staging left

    listing = json.loads(farm("builds", "list", "--json").output)
    assert [(b["name"], b["version"]) for b in listing] == [("b1", "1.2.3")]
    assert listing[0]["file_count"] == len(manifest.files)
    assert "b1" in farm("builds", "list").output
    shown = json.loads(farm("builds", "show", "b1", "--json").output)
    assert {f["path"] for f in shown["files"]} == paths

    # a second build reuses the key (no new one), and the same name is refused
    second = farm("builds", "create", "--model", str(tiny_model_dir), "--version", "1.2.4")
    assert "generated the farm signing key" not in second.output
    verify_bundle(farm.tmp / "data" / "builds" / json.loads(farm("builds", "list", "--json").output)[0]["name"],
                  config / "farm.pub")
    again = farm("builds", "create", "--model", str(tiny_model_dir), "--name", "b1", ok=False)
    assert again.exit_code == 3 and "already exists" in again.output


def test_builds_bad_input_is_one_error(farm_db, tmp_path):
    result = farm_db("builds", "create", "--model", str(tmp_path / "nope"), ok=False)
    assert result.exit_code == 3 and "not a diffusers model folder" in result.output
    result = farm_db("builds", "show", "nope", ok=False)
    assert result.exit_code == 3 and "no build 'nope'" in result.output
    assert not (tmp_path / "data" / "builds").exists()


@pytest.mark.gpu
def test_discover_local_device(farm_db, tiny_model_dir):
    farm = farm_db
    farm("builds", "create", "--model", str(tiny_model_dir), "--name", "b1")  # makes the farm key
    root = farm.tmp / "agent"
    provision_public_key(root, farm.tmp / "config" / "farm.pub")
    farm("devices", "add", "gpu-host", "--transport", "local", "--address", str(root))

    output = farm("devices", "discover").output
    assert "gpu-host" in output
    shown = json.loads(farm("devices", "show", "gpu-host", "--json").output)
    assert shown["state"] == "available", shown
    assert shown["gpu"]["backend"] and (shown["gpu"]["device"] or shown["gpu"]["vendor"])
    assert shown["last_seen"] is not None and shown["os"]


def test_builds_create_from_another_checkout_or_a_commit(farm_db, tiny_model_dir, tmp_path):
    """A pull request's build: --source ships another checkout's engine, shaders and agent as
    they are on disk (its revision marked +dirty when they hold uncommitted changes), --commit
    exactly as a commit has them; a bad revision or folder is one error and leaves nothing."""
    import hashlib
    import shutil
    import subprocess

    from orchestrator.cli.builds import PACKAGES, REPO

    farm = farm_db
    checkout = tmp_path / "pr"
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, checkout / pkg, ignore=shutil.ignore_patterns("__pycache__", "simulator"))
    git = ["git", "-C", str(checkout), "-c", "user.name=ci", "-c", "user.email=ci@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "pr"], check=True)
    commit = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    shader = next(p for p in sorted((checkout / "shaders").rglob("*.wgsl")))
    rel = shader.relative_to(checkout).as_posix()
    committed = hashlib.sha256(shader.read_bytes()).hexdigest()
    shader.write_text(shader.read_text() + "\n// a change not committed\n")
    on_disk = hashlib.sha256(shader.read_bytes()).hexdigest()

    config, builds = farm.tmp / "config", farm.tmp / "data" / "builds"
    farm("builds", "create", "--model", str(tiny_model_dir), "--name", "tree", "--source", str(checkout))
    farm("builds", "create", "--model", str(tiny_model_dir), "--name", "at-commit", "--source", str(checkout),
         "--commit", "HEAD")
    tree, at_commit = (verify_bundle(builds / name, config / "farm.pub") for name in ("tree", "at-commit"))
    assert {f.path: f.sha256 for f in tree.files}[rel] == on_disk
    assert {f.path: f.sha256 for f in at_commit.files}[rel] == committed
    assert (tree.source_revision, at_commit.source_revision) == (f"{commit}+dirty", commit)
    assert {f.path for f in tree.files} == {f.path for f in at_commit.files}

    bad = farm("builds", "create", "--model", str(tiny_model_dir), "--name", "bad", "--source", str(checkout),
               "--commit", "no-such-rev", ok=False)
    assert bad.exit_code == 3 and "'no-such-rev' is not a commit of" in bad.output
    assert len(bad.output.strip().splitlines()) == 1, bad.output
    bad = farm("builds", "create", "--model", str(tiny_model_dir), "--name", "bad", "--source", str(tmp_path),
               ok=False)
    assert bad.exit_code == 3 and "not a checkout of this project" in bad.output
    assert sorted(p.name for p in builds.iterdir()) == ["at-commit", "tree"]  # nothing staged is left


def test_a_pull_requests_links_never_bring_files_from_outside_its_tree(farm_db, tiny_model_dir, tmp_path):
    """A checkout (a pull request's, which an attacker controls) linking to the farm's own
    signing key, to /etc/passwd or to a folder outside: `--source` refuses each with one line
    naming the link and leaves no build; a link between the checkout's own folders is packed as
    its file; with `--commit`, a committed link out of the tree is one line too."""
    import shutil
    import subprocess

    from orchestrator.cli.builds import PACKAGES, REPO

    farm = farm_db
    farm("builds", "create", "--model", str(tiny_model_dir), "--name", "first")  # makes the farm key
    key, builds = farm.tmp / "config" / "farm.key", farm.tmp / "data" / "builds"
    checkout = tmp_path / "pr"
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, checkout / pkg, ignore=shutil.ignore_patterns("__pycache__", "simulator"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "notes.txt").write_text("private")
    for link, target in (("engine/leak.txt", key), ("agent/leak2.txt", Path("/etc/passwd")),
                         ("shaders/more", tmp_path / "elsewhere")):
        (checkout / link).symlink_to(target, target_is_directory=target.is_dir())
        bad = farm("builds", "create", "--model", str(tiny_model_dir), "--name", "leaky", "--source", str(checkout),
                   ok=False)
        assert bad.exit_code == 3 and "Traceback" not in bad.output, bad.output
        assert len(bad.output.strip().splitlines()) == 1, bad.output
        assert f"{link}: a link to {target.resolve()}, outside {checkout.resolve()}" in bad.output, bad.output
        (checkout / link).unlink()
    assert sorted(p.name for p in builds.iterdir()) == ["first"]  # nothing staged is left

    shader = next(p for p in sorted((checkout / "shaders").rglob("*.wgsl")))
    (checkout / "engine" / "alias.wgsl").symlink_to(Path("..") / shader.relative_to(checkout))
    farm("builds", "create", "--model", str(tiny_model_dir), "--name", "linked", "--source", str(checkout))
    files = {f.path: f.sha256 for f in verify_bundle(builds / "linked", farm.tmp / "config" / "farm.pub").files}
    assert files["engine/alias.wgsl"] == files[shader.relative_to(checkout).as_posix()]
    assert not (builds / "linked" / "files" / "engine" / "alias.wgsl").is_symlink()
    assert key.read_bytes() not in b"".join(p.read_bytes() for p in (builds / "linked").rglob("*") if p.is_file())

    (checkout / "engine" / "leak.txt").symlink_to("../../../../config/farm.key")
    git = ["git", "-C", str(checkout), "-c", "user.name=ci", "-c", "user.email=ci@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "pr"], check=True)
    bad = farm("builds", "create", "--model", str(tiny_model_dir), "--name", "leaky", "--source", str(checkout),
               "--commit", "HEAD", ok=False)
    assert bad.exit_code == 3 and "Traceback" not in bad.output, bad.output
    assert len(bad.output.strip().splitlines()) == 1, bad.output
    assert "engine/leak.txt is a link to ../../../../config/farm.key, outside the tree" in bad.output, bad.output
    assert sorted(p.name for p in builds.iterdir()) == ["first", "linked"]
