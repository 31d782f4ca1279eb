"""The farm's one typed settings object. It is read once, at the entry point (the `farm` CLI,
a worker, beat), and passed down; nothing below the entry point reads the environment.

Order of precedence, lowest first:

1. defaults: database in the data dir (SQLite), embedded broker, host name from the OS;
2. the config file `<config_dir>/farm.toml` (optional; same keys as the fields below);
3. `FARM_*` environment variables (`FARM_DATABASE_URL`, `FARM_BROKER_URL`, `FARM_DATA_DIR`,
   `FARM_CONFIG_DIR`, `FARM_HOST_NAME`, `FARM_DEVICES`);
4. the command line: the CLI passes its options to `load_settings(**overrides)`.

The config file is looked for in the config dir named by the command line, else by
`FARM_CONFIG_DIR`, else the default, so a config file cannot move itself.

| field        | default                                                        |
|--------------|----------------------------------------------------------------|
| data_dir     | $XDG_DATA_HOME/devicefarm, else ~/.local/share/devicefarm      |
| config_dir   | $XDG_CONFIG_HOME/devicefarm, else ~/.config/devicefarm         |
| database_url | sqlite:///<data_dir>/farm.db                                   |
| broker_url   | None: the embedded filesystem broker under <data_dir>/broker   |
| host_name    | socket.gethostname()                                           |
| devices      | "": devices a worker registers on its host at start, comma-separated `SERIAL=TRANSPORT:ADDRESS` (e.g. `phone-1=adb:10.0.0.7:5555`) |

The reliability knobs (docs/reliability.md says what they promise):

| field            | default | meaning |
|------------------|---------|---------|
| reconcile_every_s | 10     | beat runs the reconciler this often |
| stale_after_s    | 60      | a running job or deployment silent this long has lost its worker; on PostgreSQL a worker's or the API's session idle inside a transaction this long (at least 30 s) is ended by the server, releasing its row locks (a host cut off mid-transaction) |
| message_grace_s  | 60      | a queued job's (or pending deployment's) message must start it within this, or it is sent again |
| max_queue_wait_s | 86400   | a job still waiting for a busy device after this ends as infra_failed, saying why |
| max_job_time_s   | 3600    | the longest time limit a job may ask for; Redis redelivers an unacknowledged message after this plus a margin |

Device health (docs/devices.md):

| field               | default | meaning |
|---------------------|---------|---------|
| health_check_every_s | 180    | beat runs the health check this often: offline and unauthorized devices due for a probe are probed (with back-off), busy devices nothing holds are freed |

The hub browser devices talk to (`farm hub`; docs/phones.md):

| field           | default   | meaning |
|-----------------|-----------|---------|
| hub_port        | 8780      | plain HTTP on 127.0.0.1: workers, and phones through their reverse forwards (0: any free port) |
| hub_https_host  | 0.0.0.0   | where the HTTPS listener binds |
| hub_https_port  | 8743      | HTTPS for devices on the network, with a certificate of the farm's CA (0: any free port) |
| hub_public_host | host_name | the name devices open (`https://hub_public_host:hub_https_port`) |
| hub_names       | host name, localhost, 127.0.0.1 | the names and addresses the hub's certificate covers, comma-separated |

Notifications (`farm notify`; orchestrator/jobs/notify.py):

| field             | default   | meaning |
|-------------------|-----------|---------|
| smtp_host         | ""        | the SMTP server email subscriptions are sent through (none: email deliveries fail, saying so) |
| smtp_port         | 587       | its port; STARTTLS is used whenever the server offers it |
| smtp_user         | ""        | login, when the server asks for one (with smtp_password) |
| smtp_password     | ""        | |
| smtp_from         | farm@<host_name> | the sender address |
| smtp_ca_file      | ""        | a PEM of CAs trusted for the SMTP server's certificate beside the system's (a lab's own CA) |
| notify_timeout_s  | 10        | one attempt to reach a receiver (connect, send, the whole answer) gives up after this (then it is retried with back-off) |
| notify_private_targets | false | allow webhook and Slack receivers on loopback, private or link-local addresses (a receiver inside the lab); off, a subscription cannot make the workers probe the lab's network |

The farm API (`farm api serve`; orchestrator/api/guard.py):

| field              | default | meaning |
|--------------------|---------|---------|
| api_max_body_bytes | 1048576 | the largest request body the API reads; a larger one is answered 413 without being read (and a body to /v1 only after its token is known) |
| api_request_deadline_s | 10 | a connection must send a whole request head within this of opening or of its last answer, and a body within this of its head, or it is closed (408 for a body) |
| api_max_connections | 100 | connections and requests served at once; above it, 503 |

Retention (`farm retention`; orchestrator/store/retention.py, which beat applies daily): how
many days a run's data is kept as it came (0: for ever).

| field                 | default | then |
|-----------------------|---------|------|
| retention_raw_days    | 90      | raw samples become a summary per (run, metric) that keeps the run's median |
| retention_kernel_days | 90      | kernel timings become one per (run, kernel), the median over repetitions |
| retention_image_days  | 180     | images are deleted, but the newest per (device, workload, prompt, seed) |
| retention_log_days    | 30      | job log files under <data_dir>/results are deleted |
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

CONFIG_FILE_NAME = "farm.toml"
# The shortest idle-in-transaction limit (Settings.idle_transaction_s): an analysis may compute for
# a while between two reads of one snapshot.
IDLE_TRANSACTION_MIN_S = 30.0


def _xdg(var: str, fallback: str) -> Path:
    base = os.environ.get(var)
    return (Path(base) if base else Path.home() / fallback) / "devicefarm"


def default_data_dir() -> Path:
    return _xdg("XDG_DATA_HOME", ".local/share")


def default_config_dir() -> Path:
    return _xdg("XDG_CONFIG_HOME", ".config")


class Settings(BaseSettings):
    """Where the farm keeps its state and how it reaches its database and broker."""

    model_config = SettingsConfigDict(env_prefix="FARM_", extra="forbid")

    data_dir: Path = Field(default_factory=default_data_dir)
    config_dir: Path = Field(default_factory=default_config_dir)
    database_url: str | None = None  # filled in from data_dir when not given
    broker_url: str | None = None  # None: the embedded filesystem broker in data_dir
    host_name: str = Field(default_factory=socket.gethostname)
    devices: str = ""  # what `farm worker` registers on its host: SERIAL=TRANSPORT:ADDRESS,...
    reconcile_every_s: float = Field(10.0, gt=0)
    stale_after_s: float = Field(60.0, gt=0)
    message_grace_s: float = Field(60.0, gt=0)
    max_queue_wait_s: float = Field(86400.0, gt=0)
    max_job_time_s: float = Field(3600.0, gt=0)
    health_check_every_s: float = Field(180.0, gt=0)
    # The hub browser devices talk to (`farm hub`; orchestrator/transports/hub.py): plain HTTP on
    # 127.0.0.1:hub_port for workers and for phones' reverse forwards, HTTPS on
    # hub_https_host:hub_https_port for devices on the network, with a certificate of the farm's
    # CA for hub_names (default: host_name, localhost, 127.0.0.1) and the URL devices open at
    # https://hub_public_host:hub_https_port (default host: host_name).
    hub_port: int = Field(8780, ge=0, le=65535)  # 0: any free port (the running hub says which: hub.json)
    hub_https_host: str = "0.0.0.0"
    hub_https_port: int = Field(8743, ge=0, le=65535)
    hub_public_host: str = ""
    hub_names: str = ""
    # Notifications (orchestrator/jobs/notify.py): the SMTP server email subscriptions go through.
    smtp_host: str = ""
    smtp_port: int = Field(587, ge=1, le=65535)
    smtp_user: str = ""
    smtp_password: str = ""
    smtp_from: str = ""
    smtp_ca_file: str = ""  # PEM: CAs trusted for the SMTP server's STARTTLS certificate, beside the system's
    notify_timeout_s: float = Field(10.0, gt=0)
    notify_private_targets: bool = False  # webhook and Slack receivers on loopback or private addresses
    # The farm API (`farm api serve`; orchestrator/api/guard.py): the largest request body it reads.
    api_max_body_bytes: int = Field(1 << 20, ge=1024)
    api_request_deadline_s: float = Field(10.0, gt=0)  # a connection's request head must arrive within this
    api_max_connections: int = Field(100, ge=1)  # connections and requests served at once (503 above)
    # Retention (orchestrator/store/retention.py): days a run's data is kept as it came; 0: for ever.
    retention_raw_days: float = Field(90.0, ge=0)
    retention_kernel_days: float = Field(90.0, ge=0)
    retention_image_days: float = Field(180.0, ge=0)
    retention_log_days: float = Field(30.0, ge=0)

    @model_validator(mode="after")
    def _derive(self) -> Settings:
        self.data_dir = self.data_dir.expanduser()
        self.config_dir = self.config_dir.expanduser()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'farm.db'}"
        return self

    def device_entries(self) -> list[tuple[str, str, str]]:
        """`devices` parsed into (serial, transport, address); ValueError naming a bad entry."""
        return [parse_device_entry(entry) for entry in self.devices.split(",") if entry.strip()]

    @property
    def config_file(self) -> Path:
        return self.config_dir / CONFIG_FILE_NAME

    @property
    def idle_transaction_s(self) -> float:
        """How long a worker's or the API's PostgreSQL session may sit idle inside a transaction
        before the server ends it (store.make_engine): the farm's transactions are short, so one
        idle this long belongs to a process cut off from the database, whose row locks would
        otherwise hold up every other worker until the server's TCP keepalive notices, hours
        later. stale_after_s, at least IDLE_TRANSACTION_MIN_S."""
        return max(IDLE_TRANSACTION_MIN_S, self.stale_after_s)

    @property
    def adb_key(self) -> Path:
        """This host's ADB private key (made on first use; phones trust its .pub)."""
        return self.config_dir / "adbkey"

    @property
    def hub_file(self) -> Path:
        """What `farm hub` writes while it runs (0600): its farm side's key and its ports."""
        return self.config_dir / "hub.json"

    @property
    def hub_public_url(self) -> str:
        return f"https://{self.hub_public_host or self.host_name}:{self.hub_https_port}"

    def hub_cert_names(self) -> list[str]:
        names = [n.strip() for n in self.hub_names.split(",") if n.strip()]
        return names or list(dict.fromkeys([self.hub_public_host or self.host_name, "localhost", "127.0.0.1"]))

    @property
    def browser_tokens_dir(self) -> Path:
        """One file per browser device: its page's token (0600)."""
        return self.config_dir / "tokens" / "browser"

    @property
    def broker_dir(self) -> Path:
        """The embedded broker's folders live here when broker_url is None."""
        return self.data_dir / "broker"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The config file's location is itself a setting: take it from the command line or
        # the environment before reading the file.
        init_kwargs = init_settings.init_kwargs if isinstance(init_settings, InitSettingsSource) else {}
        config_dir = init_kwargs.get("config_dir") or os.environ.get("FARM_CONFIG_DIR")
        config_file = Path(config_dir).expanduser() if config_dir else default_config_dir()
        toml = TomlConfigSettingsSource(settings_cls, toml_file=config_file / CONFIG_FILE_NAME)
        return (init_settings, env_settings, toml)


def parse_device_entry(entry: str) -> tuple[str, str, str]:
    """`SERIAL=TRANSPORT:ADDRESS` (the address may hold colons: host:port, a URL) ->
    (serial, transport, address), the serial and the address checked as `farm devices add`
    checks them and the address in its canonical form; ValueError naming the entry."""
    from orchestrator.infra.inputs import TRANSPORTS, BadInput, check_serial, parse_device_address

    serial, sep, rest = entry.strip().partition("=")
    transport, _, address = rest.partition(":")
    if not sep or not serial or transport not in TRANSPORTS:
        raise ValueError(f"bad device entry {entry.strip()!r}: expected SERIAL=TRANSPORT:ADDRESS with "
                         f"TRANSPORT one of {', '.join(TRANSPORTS)} (e.g. phone-1=adb:10.0.0.7:5555)")
    try:
        return check_serial(serial), transport, str(parse_device_address(transport, address))
    except BadInput as exc:
        raise ValueError(f"bad device entry {entry.strip()!r}: {exc}") from None


def load_settings(**overrides: Any) -> Settings:
    """The settings for this process; `overrides` are command-line values (None = not given)."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
