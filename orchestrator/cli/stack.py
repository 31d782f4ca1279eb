"""`farm worker`, `farm beat`, `farm hub` and `farm up`: the processes that do the farm's work.
A worker drives the devices plugged into its host (queue host.<name>) plus shared maintenance
work; beat ticks the database's schedules and the stale-job sweep; the hub serves browser
devices' pages; `up` runs the whole embedded stack (worker, beat, hub, virtual phones) in one
process tree until Ctrl-C."""

from __future__ import annotations

import os
import time

import typer

from . import validate
from .devices import _settings, console, fail, open_store

HOST_OPTION = typer.Option(None, "--host", help="This host's name (default: FARM_HOST_NAME, else the OS host name).",
                           callback=validate.host_name)


def register_devices(settings, entries: list[tuple[str, str, str]]) -> None:
    """Record `entries` (serial, transport, address) as devices plugged into this host."""
    from orchestrator.db import store

    with open_store(settings) as sessions, sessions() as session:
        for serial, transport, address in entries:
            store.upsert_device(session, serial, transport, address, host=settings.host_name)
        store.get_or_create_host(session, settings.host_name)
        session.commit()


def worker(
    host: str = HOST_OPTION,
    concurrency: int = typer.Option(2, "--concurrency", "-c", min=1, help="Jobs this worker runs at once "
                                    "(one per device it drives is typical)."),
    device: list[str] = typer.Option(None, "--device", help="SERIAL=TRANSPORT:ADDRESS of a device plugged into "
                                     "this host (repeatable; FARM_DEVICES adds more).",
                                     callback=validate.device_entries),
    loglevel: str = typer.Option("info", "--loglevel", "-l", help="Celery log level."),
):
    """Run a Celery worker for this host's devices (queues host.<name> and farm)."""
    from orchestrator.celery_app import make_celery, worker_queues
    from orchestrator.settings import parse_device_entry

    settings = _settings(host_name=host)
    try:
        entries = settings.device_entries() + [parse_device_entry(d) for d in device or []]
    except ValueError as exc:
        fail(str(exc))
    register_devices(settings, entries)
    app = make_celery(settings)
    app.worker_main(["worker", "-Q", ",".join(worker_queues(settings)), "-c", str(concurrency),
                     "-n", f"farm@{settings.host_name}", "--without-gossip", "--without-mingle",
                     "-l", loglevel])


def hub(
    https: bool = typer.Option(True, "--https/--no-https", help="Also serve devices on the network over HTTPS "
                               "(the farm's CA is made on first use: `farm ca export` for the devices)."),
):
    """Run the hub browser devices talk to: HTTP on 127.0.0.1 (workers, phones' reverse forwards)
    and HTTPS for phones and tablets on the network (README: Real phones). One per farm host."""
    import signal
    import threading

    from orchestrator import ca
    from orchestrator.browser_hub import BrowserHub

    settings = _settings()
    tls = None
    if https:
        folder = ca.default_dir(settings.config_dir)
        try:
            ca.load_ca_cert(folder)
        except ca.NoCa:
            ca.init_ca(folder, f"devicefarm CA {settings.host_name}"[:64])
            console.print(f"made the farm's CA in {folder}; install it on the devices: `farm ca export`",
                          highlight=False)
        except ca.CaError as exc:
            fail(str(exc))
        try:
            tls = (settings.hub_https_host, settings.hub_https_port,
                   ca.server_ssl_context(folder, settings.hub_cert_names()))
        except ca.CaError as exc:
            fail(str(exc))
    try:
        running = BrowserHub("127.0.0.1", settings.hub_port, https=tls, tokens_dir=settings.browser_tokens_dir,
                             stores=settings.data_dir / "devices")
    except OSError as exc:
        fail(f"cannot listen: {exc} (is another `farm hub` running? set hub_port / hub_https_port)")
    settings.config_dir.mkdir(parents=True, exist_ok=True)
    key_file = settings.hub_key_file
    key_file.unlink(missing_ok=True)
    with open(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(running.key + "\n")
    console.print(f"hub listening on 127.0.0.1:{running.port}"
                  + (f" and https://{settings.hub_https_host}:{running.https_port} ({settings.hub_public_url})"
                     if tls else ""), highlight=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        running.close()
        key_file.unlink(missing_ok=True)


def beat(loglevel: str = typer.Option("info", "--loglevel", "-l", help="Celery log level.")):
    """Run Celery beat: fires the database's schedules (`farm schedules`) and sweeps stale jobs.
    Run one per farm (a second one fires nothing twice, but wastes work)."""
    from orchestrator.celery_app import make_celery

    settings = _settings()
    with open_store(settings):
        pass  # refuse to start against a database that is not at head
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    app = make_celery(settings)
    app.start(["beat", "-s", str(settings.data_dir / "celerybeat-schedule"), "-l", loglevel])


def up(
    phones: int = typer.Option(2, "--phones", min=0, help="Virtual phones to start (reached over ADB)."),
    host_gpu: bool = typer.Option(True, "--host-gpu/--no-host-gpu", help="Register this host's GPU as a device "
                                  "(local transport)."),
    concurrency: int = typer.Option(None, "--concurrency", "-c", help="Worker concurrency (default: one per device)."),
):
    """Run the embedded stack until Ctrl-C: a worker, beat and virtual phones, with this host's
    GPU as a device. Every process it started is stopped when it returns."""
    settings = _settings()
    with open_store(settings):
        pass
    with start_stack(settings, phones=phones, host_gpu=host_gpu, concurrency=concurrency, beat=True) as stack:
        console.print(f"[bold green]farm up[/]: {len(stack.devices)} devices on host {settings.host_name} "
                      f"({', '.join(stack.devices)}); logs in {stack.stack.log_dir}. Ctrl-C stops everything.")
        try:
            while True:
                stack.stack.check_alive()
                time.sleep(1.0)
        except KeyboardInterrupt:
            console.print("stopping the stack")
        except Exception as exc:  # noqa: BLE001  (a child died: say which, then stop the rest)
            console.print(f"[bold red]error:[/] {exc}", highlight=False)
            raise typer.Exit(1) from None


class RunningStack:
    """The embedded stack with its devices registered; `with` stops it."""

    def __init__(self, settings, stack, devices: list[str]):
        self.settings, self.stack, self.devices = settings, stack, devices

    def __enter__(self) -> RunningStack:
        return self

    def __exit__(self, *exc) -> None:
        with console.status("stopping worker, beat and phones"):
            self.stack.stop()


HOST_GPU_SERIAL = "host-gpu"


def start_stack(settings, *, phones: int, host_gpu: bool, concurrency: int | None, beat: bool) -> RunningStack:
    """Start phones, register them (and the host GPU) as devices of this host, start the worker
    (and beat), probe every device; stops what it started when anything fails."""
    from agent.bundle import provision_public_key
    from orchestrator.celery_app import make_celery
    from orchestrator.stack import Stack, StackError
    from orchestrator.transports.adb import load_or_create_adb_key
    from orchestrator.transports.base import TransportError

    from .builds import PUBLIC_KEY, farm_key

    farm_key(settings.config_dir)
    public = settings.config_dir / PUBLIC_KEY
    stack = Stack(settings)
    try:
        entries = []
        if host_gpu:
            root = settings.data_dir / "devices" / HOST_GPU_SERIAL
            provision_public_key(root, public)
            entries.append((HOST_GPU_SERIAL, "local", str(root)))
        if phones:
            # The phones ask for ADB authentication and know one host: the key the worker's adb
            # transport signs with, as a real phone knows the host it was paired with.
            adb_key = load_or_create_adb_key(settings.adb_key)
            adb_public = adb_key.with_name(adb_key.name + ".pub")
        with console.status(f"starting {phones} virtual phones"):
            for index in range(1, phones + 1):
                serial = f"vphone-{index}"
                _, port = stack.start_phone(serial, public, adb_public,
                                            model="Pixel 7" if index % 2 else "Galaxy S23 Ultra")
                entries.append((serial, "adb", f"127.0.0.1:{port}"))
        if not entries:
            fail("no devices: start phones (--phones N) or keep the host GPU")
        register_devices(settings, entries)
        with console.status("starting the worker"):
            stack.start_worker(concurrency or len(entries))
            if beat:
                stack.start_beat()
            stack.wait_worker_ready(make_celery(settings))
        _probe_all(settings, [serial for serial, _, _ in entries])
    except (StackError, TransportError) as exc:
        stack.stop()
        fail(str(exc))
    except BaseException:
        stack.stop()
        raise
    return RunningStack(settings, stack, [serial for serial, _, _ in entries])


def _probe_all(settings, serials: list[str]) -> None:
    from sqlalchemy import select

    from orchestrator.db.models import Device

    from .devices import probe

    with open_store(settings) as sessions:
        with sessions() as session:
            devices = list(session.scalars(select(Device).where(Device.serial.in_(serials))))
        with console.status("probing devices"):
            for device in devices:
                outcome = probe(settings, sessions, device)
                if outcome["error"]:
                    console.print(f"[yellow]warning:[/] {device.serial}: {outcome['error']}", highlight=False)
