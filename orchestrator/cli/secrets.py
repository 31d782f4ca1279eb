"""`farm secrets ...`: the production stack's secrets. `init` writes the `.env` that
docker-compose.yml reads: a random password for each service (PostgreSQL's owner of the store,
Grafana's read-only database role, Redis, Flower, Grafana's admin), mode 0600, never replacing
an existing file unless told to. `public-keys` makes the farm's signing key and this host's ADB
key when missing and copies only their public halves into a folder, the one devices mount."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

import typer

from .common import cli_settings, fail
from .output import console

app = typer.Typer(help="Secrets of the production stack: its .env and the keys devices trust.",
                  no_args_is_help=True)

# docker-compose.yml requires each of these (${VAR:?...}); what each one guards.
SECRETS = {
    "FARM_DB_PASSWORD": "PostgreSQL, the store's owner (user FARM_DB_USER, default farm)",
    "FARM_GRAFANA_DB_PASSWORD": "PostgreSQL, Grafana's read-only role (user FARM_GRAFANA_DB_USER, default grafana)",
    "FARM_REDIS_PASSWORD": "Redis, the Celery broker",
    "FARM_FLOWER_PASSWORD": "Flower's web UI (user FARM_FLOWER_USER, default admin)",
    "FARM_GRAFANA_PASSWORD": "Grafana's admin (user FARM_GRAFANA_USER, default admin)",
}
ADB_PUBLIC_KEY = "adbkey.pub"


def env_text() -> str:
    lines = ["# The production stack's secrets, written by `farm secrets init`; docker compose reads this",
             "# file from the folder it runs in. Keep it 0600 and out of version control. PostgreSQL takes",
             "# its passwords when its volume is first made: changing them here later locks services out.", ""]
    for name, what in SECRETS.items():
        # URL-safe: the passwords also sit inside the database and broker URLs.
        lines += [f"# {what}", f"{name}={secrets.token_urlsafe(32)}"]
    return "\n".join(lines) + "\n"


def write_private(path: Path, text: str) -> None:
    """`text` to `path`, mode 0600 from the first byte, replacing it whole (never half written)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp makes it 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@app.command()
def init(
    env_file: Path = typer.Option(Path(".env"), "--env-file", help="Where to write (docker compose reads .env "
                                  "beside docker-compose.yml)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing file (new passwords: recreate the "
                               "postgres and redis volumes, or set the new passwords there by hand)."),
):
    """Write the .env of docker-compose.yml with a random password for every service (mode 0600)."""
    if env_file.is_dir():
        fail(f"{env_file} is a folder; give the file to write, e.g. --env-file {env_file / '.env'}")
    if env_file.exists() and not force:
        fail(f"{env_file} exists; the stack's services were set up with its passwords. Keep it, or replace "
             "it with --force")
    if not env_file.parent.is_dir():
        fail(f"no folder {env_file.parent} to write {env_file.name} in; create it first")
    write_private(env_file, env_text())
    console.print(f"wrote {env_file} (mode 600) with random {', '.join(SECRETS)}", highlight=False, soft_wrap=True)


@app.command("public-keys")
def public_keys(
    folder: Path = typer.Argument(..., help="Folder to copy farm.pub and adbkey.pub into (made if missing)."),
    adb_key: Path = typer.Option(None, help="This host's ADB private key (default: the one the worker's adb "
                                 "transport signs with, <config_dir>/adbkey).", show_default=False),
):
    """Make the farm signing key and this host's ADB key if missing; copy their public halves to FOLDER.

    Devices trust those two files: farm.pub to accept signed builds, adbkey.pub to let this host
    in over ADB. The private halves stay in the config dir."""
    from orchestrator.infra.keys import PUBLIC_KEY
    from orchestrator.transports.adb import load_or_create_adb_key
    from orchestrator.transports.base import TransportError

    from .builds import farm_key

    settings = cli_settings()
    if folder.exists() and not folder.is_dir():
        fail(f"{folder} is not a folder; give the folder devices mount, e.g. /public")
    farm_key(settings.config_dir)
    try:
        # The adb transport's own key: the one this host's worker signs ADB connections with.
        adb_key = load_or_create_adb_key((adb_key or settings.adb_key).expanduser())
    except TransportError as exc:
        fail(exc.detail)
    folder.mkdir(parents=True, exist_ok=True)
    for source, name in ((settings.config_dir / PUBLIC_KEY, PUBLIC_KEY),
                         (adb_key.with_name(adb_key.name + ".pub"), ADB_PUBLIC_KEY)):
        tmp = folder / f".{name}.tmp"
        shutil.copyfile(source, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / name)
        console.print(f"{folder / name} (from {source})", highlight=False, soft_wrap=True)
