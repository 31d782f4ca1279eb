"""Bad input to `farm`, through CliRunner on a fresh migrated SQLite store: every argument that
names an address, a port, an id, a name that becomes a path, or a path is refused where it
enters, as one red `error:` line naming the value, with a non-zero exit and nothing written;
a device whose stored serial or address cannot be used (an older farm, a hand-edited database)
is named by `farm devices discover` and `farm deploy`, which then exit non-zero. Also the
parsers behind them (orchestrator/infra/inputs.py), which FARM_DEVICES and `farm worker --device`
go through too."""

from __future__ import annotations

import json

import pytest

from agent.protocol import Manifest, ManifestFile
from orchestrator import store
from orchestrator.infra import inputs
from orchestrator.infra.settings import parse_device_entry

USAGE = 3  # bad input, usage errors included (docs/cli.md)


@pytest.fixture
def farm(cli):
    """The CLI over a migrated, empty farm (conftest's `cli`)."""
    return cli


def one_error(result, *fragments: str, code: int = USAGE) -> str:
    """Exit `code`, one line that starts with `error:` and holds every fragment, no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for fragment in fragments:
        assert fragment in lines[0], result.output
    return lines[0]


def no_devices(farm) -> None:
    assert json.loads(farm("devices", "list", "--json").output) == []


# ---- addresses and ports ------------------------------------------------------------------


def test_adb_address_whose_port_is_not_a_number_is_refused(farm):
    for args in (["--transport", "adb", "--address", "host:abc"], ["--address", "host:abc", "--transport", "adb"]):
        one_error(farm("devices", "add", "p1", *args, ok=False), "--address", "'host:abc'", "port 'abc'",
                  "HOST:PORT")
    no_devices(farm)


@pytest.mark.parametrize(("transport", "address", "bad"), [
    ("adb", "127.0.0.1:70000", "70000"),
    ("adb", "127.0.0.1:0", "port 0"),
    ("http", "http://127.0.0.1:99999", "99999"),
    ("http", "http://127.0.0.1:0", "port 0"),
])
def test_port_out_of_range_is_refused(farm, transport, address, bad):
    one_error(farm("devices", "add", "p1", "--transport", transport, "--address", address, ok=False), bad,
              "1 to 65535")
    no_devices(farm)


def test_listen_port_out_of_range_is_one_line(farm):
    one_error(farm("dashboard", "serve", "--port", "70000", ok=False), "--port", "70000")
    one_error(farm("dashboard", "serve", "--port", "http", ok=False), "--port", "'http'")
    one_error(farm("dashboard", "serve", "--host", "0.0.0.0/8", ok=False), "--host", "0.0.0.0/8")
    assert not (farm.tmp / "data" / "dashboard").exists()  # refused before anything was built


@pytest.mark.parametrize(("transport", "address", "why"), [
    ("adb", "http://10.0.0.7:5555", "does not take a URL"),
    ("http", "ftp://10.0.0.7:8765", "not 'ftp'"),
    ("http", "10.0.0.7:8765", "http://10.0.0.7:8765"),
    ("http", "", "needs its agent's URL"),
    ("http", "http://farm:secret@10.0.0.7:8765", "no user or password"),
])
def test_address_must_fit_the_transport(farm, transport, address, why):
    one_error(farm("devices", "add", "p1", "--transport", transport, "--address", address, ok=False), why)
    no_devices(farm)


def test_local_address_is_a_folder_stored_absolute(farm, monkeypatch):
    afile = farm.tmp / "afile"
    afile.write_text("x")
    one_error(farm("devices", "add", "g", "--transport", "local", "--address", str(afile), ok=False), "is a file")
    no_devices(farm)
    monkeypatch.chdir(farm.tmp)
    farm("devices", "add", "g", "--transport", "local", "--address", "agent-root")
    farm("devices", "add", "p1", "--transport", "adb", "--address", "10.0.0.7")
    farm("devices", "add", "p2", "--transport", "http", "--address", "https://phone-2.lab:8765/")
    stored = {d["serial"]: d["address"] for d in json.loads(farm("devices", "list", "--json").output)}
    assert stored == {"g": str(farm.tmp / "agent-root"), "p1": "10.0.0.7:5555", "p2": "https://phone-2.lab:8765"}


# ---- names that become paths, and ids -----------------------------------------------------


@pytest.mark.parametrize("serial", ["../x", "a/b", "..", "a b", "tab\there", "x\n", ".hidden"])
def test_serial_that_would_become_a_path_is_refused(farm, serial):
    # A local device's default agent root is <data_dir>/devices/<serial>, an http device's token
    # <config_dir>/tokens/<serial>.
    one_error(farm("devices", "add", serial, "--transport", "local", ok=False), "device serial", "plain name")
    one_error(farm("devices", "add", "p1", "--transport", "adb", "--address", f"usb:{serial}", ok=False),
              repr(f"usb:{serial}"))
    no_devices(farm)


def test_build_and_host_names_that_would_become_paths_are_refused(farm, tiny_model_dir):
    for name in ("../../x", "a b", "current"):
        one_error(farm("builds", "create", "--model", str(tiny_model_dir), "--name", name, ok=False), "--name")
    one_error(farm("builds", "create", "--model", str(tiny_model_dir), "--version", "1.0/../../x", ok=False),
              "--version")
    assert not (farm.tmp / "data").exists()
    # The host name is the worker's queue (host.<name>): a file name in the embedded broker.
    one_error(farm("worker", "--host", "lab/1", ok=False), "--host", "'lab/1'")
    one_error(farm("worker", "--device", "../x=adb:10.0.0.7:5555", ok=False), "--device", "'../x'")
    one_error(farm("worker", "--device", "p1=adb:host:abc", ok=False), "--device", "port 'abc'")
    no_devices(farm)


@pytest.mark.parametrize("args", [
    ["jobs", "show", "abc"], ["jobs", "cancel", "1x"], ["jobs", "logs", "x"], ["results", "show", "run-1"],
    ["regressions", "ack", "nope"], ["regressions", "show", "1.5"], ["jobs", "list", "--batch", "b"],
])
def test_id_that_is_not_a_number_is_refused(farm, args):
    one_error(farm(*args, ok=False), repr(args[-1]), "not an id")


def test_id_below_one_is_refused(farm):
    one_error(farm("jobs", "show", "0", ok=False), "ids start at 1")
    one_error(farm("jobs", "show", "--", "-3", ok=False), "ids start at 1")


def test_path_in_a_build_that_climbs_out_is_refused(farm):
    one_error(farm("jobs", "submit", "latency", "--all", "--model", "models/../../etc", ok=False), "--model")
    one_error(farm("schedules", "add", "nightly", "--cron", "0 2 * * *", "--profile", "../x.json", ok=False),
              "--profile")


# ---- paths --------------------------------------------------------------------------------


def test_path_that_does_not_exist_is_one_line(farm, tiny_model_dir):
    # These commands check what they read themselves (and did before this module existed).
    missing = farm.tmp / "nope"
    one_error(farm("builds", "create", "--model", str(missing), ok=False), str(missing), code=3)
    one_error(farm("builds", "create", "--model", str(tiny_model_dir), "--profiles", str(missing), ok=False),
              str(missing), code=3)
    one_error(farm("results", "export", "--csv", str(missing / "x.csv"), ok=False), str(missing), code=3)
    assert not missing.exists()


def test_output_path_of_the_wrong_kind_is_refused_before_any_work(farm):
    afile = farm.tmp / "afile"
    afile.write_text("x")
    folder = farm.tmp / "folder"
    folder.mkdir()
    cases = [
        (["engine", "tune", "--preset", "tiny", "--out", str(folder)], "--out", "is a folder"),
        (["engine", "bench", "--preset", "tiny", "--json", str(folder)], "--json", "is a folder"),
        (["engine", "generate", "--model", str(folder), "--prompt", "x", "--out", str(folder)], "--out",
         "is a folder"),
        (["engine", "make-model", "--out", str(afile)], "--out", "is a file"),
        (["dashboard", "build", "--out", str(afile)], "--out", "is a file"),
    ]
    for args, option, why in cases:
        one_error(farm(*args, ok=False), option, why)
    assert afile.read_text() == "x" and list(folder.iterdir()) == []


def test_database_url_that_does_not_parse_is_refused(farm):
    one_error(farm("db", "upgrade", "--url", "farm.db", ok=False), "--url", "'farm.db'", "sqlite:///")


# ---- devices already stored with a bad address --------------------------------------------


def _store_device(farm, serial: str, transport: str, address: str) -> None:
    """Stored past the CLI: what an older farm, or a hand-edited database, may hold."""
    with farm.Session() as session:
        store.upsert_device(session, serial, transport, address, host="testhost")
        session.commit()


def test_discover_names_a_device_whose_stored_address_is_bad_and_exits_non_zero(farm):
    _store_device(farm, "p1", "adb", "host:abc")
    _store_device(farm, "p2", "adb", "127.0.0.1:1")  # valid, nobody there: offline, not an error
    result = farm("devices", "discover", ok=False)
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output and "ValueError" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    assert "'p1'" in errors[0] and "'host:abc'" in errors[0] and "farm devices set-address p1" in errors[0]

    out = json.loads(farm("devices", "discover", "--json", ok=False).output)
    by_serial = {o["serial"]: o for o in out}
    assert by_serial["p1"]["state"] == "offline" and "host:abc" in by_serial["p1"]["address_error"]
    assert by_serial["p2"]["state"] == "offline" and by_serial["p2"]["address_error"] is None

    farm("devices", "set-address", "p1", "127.0.0.1:1")
    assert farm("devices", "discover").exit_code == 0
    one_error(farm("devices", "set-address", "p1", "127.0.0.1:abc", ok=False), "port 'abc'")


def test_discover_names_a_stored_serial_that_would_become_a_path(farm):
    _store_device(farm, "../x", "local", "")
    result = farm("devices", "discover", ok=False)
    assert result.exit_code == 3, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "'../x'" in errors[0] and "farm devices remove" in errors[0], result.output
    assert not (farm.tmp / "data" / "x").exists()


def test_deploy_refuses_a_device_whose_stored_address_is_bad(farm):
    _store_device(farm, "p1", "adb", "host:abc")
    manifest = Manifest(build="b1", version="1", created=0.0,
                        files=[ManifestFile("engine/__init__.py", "a" * 64, 1)])
    with farm.Session() as session:
        store.create_build(session, manifest)
        session.commit()
    (farm.tmp / "data" / "builds" / "b1").mkdir(parents=True)
    one_error(farm("deploy", "b1", "--device", "p1", "--timeout", "5", ok=False), "'p1'", "'host:abc'", code=3)


# ---- the parsers ----------------------------------------------------------------------------


def test_parse_device_address_forms():
    p = inputs.parse_device_address
    assert p("adb", "10.0.0.7:5555") == inputs.AdbTcpAddress("10.0.0.7", 5555)
    assert p("adb", "phone-1.lab") == inputs.AdbTcpAddress("phone-1.lab", 5555)
    assert p("adb", "[fe80::1]:5037") == inputs.AdbTcpAddress("fe80::1", 5037)
    assert str(p("adb", "[fe80::1]:5037")) == "[fe80::1]:5037"
    assert p("adb", "usb:1A2B3C") == inputs.AdbUsbAddress("1A2B3C")
    assert p("adb", "") == inputs.AdbUsbAddress(None) == p("adb", "usb:")
    assert p("http", "https://10.0.0.7:8765/agent/") == inputs.HttpAddress("https://10.0.0.7:8765/agent")
    assert p("local", "") == inputs.LocalAddress(None)
    assert p("local", "/srv/agent") == inputs.LocalAddress(inputs.Path("/srv/agent"))
    for transport, address in [("adb", "host:abc"), ("adb", "h:"), ("adb", "fe80::1"), ("adb", "h:1:2"),
                               ("adb", "bad host:5555"), ("adb", "usb:a/b"), ("http", "http://"),
                               ("http", "http://h:x"), ("http", "http://h/?q=1"), ("local", "agent"),
                               ("local", "/srv/a\nb"), ("carrier-pigeon", "x")]:
        with pytest.raises(inputs.BadInput, match="'"):
            p(transport, address)


def test_device_entries_from_settings_are_checked():
    assert parse_device_entry("phone-1=adb:10.0.0.7") == ("phone-1", "adb", "10.0.0.7:5555")
    for entry in ("../x=adb:10.0.0.7:5555", "p=adb:host:abc", "p=http:10.0.0.7:8765", "p=local:rel/dir"):
        with pytest.raises(ValueError, match="bad device entry"):
            parse_device_entry(entry)


def test_dashboard_build_writes_only_into_its_own_or_an_empty_folder(farm, tmp_path):
    """`--out` at a project's folder used to lose its data/ and static/ (they are the site's and
    rewritten whole): a folder holding anything but an earlier dashboard is refused in one line
    and left as it was; a new folder, an empty one and the site's own are written."""
    project = tmp_path / "project"
    (project / "data" / "experiments").mkdir(parents=True)
    (project / "static").mkdir()
    (project / "data" / "experiments" / "results.csv").write_text("run,ms\n1,10\n")
    (project / "static" / "site.css").write_text("body {}\n")
    one_error(farm("dashboard", "build", "--out", str(project), ok=False), str(project),
              "not a dashboard this farm wrote", code=3)
    assert (project / "data" / "experiments" / "results.csv").read_text() == "run,ms\n1,10\n"
    assert (project / "static" / "site.css").read_text() == "body {}\n"
    assert sorted(p.name for p in project.iterdir()) == ["data", "static"]

    site = tmp_path / "site"
    for _ in range(2):  # new, then its own: written again
        farm("dashboard", "build", "--out", str(site))
        assert (site / "index.html").is_file() and (site / ".devicefarm-dashboard").is_file()
    (tmp_path / "empty").mkdir()
    farm("dashboard", "build", "--out", str(tmp_path / "empty"))
    assert (tmp_path / "empty" / "index.html").is_file()
