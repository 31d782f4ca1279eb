"""`farm worker`, `farm beat`, `farm hub` and `farm up`: the processes that do the farm's work.
A worker drives the devices plugged into its host (queue host.<name>) plus shared maintenance
work; beat ticks the database's schedules and the stale-job sweep; the hub serves browser
devices' pages; `up` runs the whole embedded stack (worker, beat, hub, virtual phones) in one
process tree until Ctrl-C."""

from __future__ import annotations

import os
import signal
import threading
import time

import typer

from . import validate
from .common import COULD_NOT_RUN, cli_settings, could_not_run, fail, open_store
from .output import console, escape

HOST_OPTION = typer.Option(None, "--host", help="This host's name (default: FARM_HOST_NAME, else the OS host name).",
                           callback=validate.host_name)


def register_devices(settings, entries: list[tuple[str, ...]]) -> None:
    """Record `entries` (serial, transport, address[, engine_host]) as devices plugged into this host."""
    from orchestrator import store

    with open_store(settings) as sessions, sessions() as session:
        for serial, transport, address, *engine_host in entries:
            store.upsert_device(session, serial, transport, address, host=settings.host_name,
                                engine_host=engine_host[0] if engine_host else None)
        store.get_or_create_host(session, settings.host_name)
        session.commit()


def registered_here(settings, skip: set[str]) -> list[str]:
    """The serials of the real devices registered on this host, or on none (their jobs go to this
    host's queue), but those in `skip`: what `farm up` drives beside its virtual devices. A
    virtual device of an earlier stack is not among them: its process is gone."""
    from orchestrator.store import queries

    with open_store(settings) as sessions, sessions() as session:
        return [d.serial for d in queries.list_devices(session)
                if d.serial not in skip and not d.virtual
                and (d.host is None or d.host.name == settings.host_name)]


def worker(
    host: str = HOST_OPTION,
    concurrency: int = typer.Option(2, "--concurrency", "-c", min=1, help="Jobs this worker runs at once "
                                    "(one per device it drives is typical)."),
    device: list[str] = typer.Option(None, "--device", help="SERIAL=TRANSPORT:ADDRESS of a device plugged into "
                                     "this host (repeatable; FARM_DEVICES adds more).",
                                     callback=validate.device_entries),
    notify_concurrency: int = typer.Option(4, "--notify-concurrency", min=0, help="Notification deliveries sent "
                                           "at once by the notifier started beside this worker (0: none here; "
                                           "another host's worker sends them)."),
    loglevel: str = typer.Option("info", "--loglevel", "-l", help="Celery log level."),
):
    """Run a Celery worker for this host's devices (queues host.<name> and farm), and beside it a
    notifier (queue notify) that sends notifications in threads of its own."""
    from orchestrator.infra.settings import parse_device_entry
    from orchestrator.jobs.celery_app import make_celery, worker_queues
    from orchestrator.services.stack import Notifier

    settings = cli_settings(host_name=host)
    try:
        entries = settings.device_entries() + [parse_device_entry(d) for d in device or []]
    except ValueError as exc:
        fail(str(exc))
    register_devices(settings, entries)
    app = make_celery(settings)
    notifier = Notifier(settings, notify_concurrency, loglevel) if notify_concurrency else None
    try:
        app.worker_main(["worker", "-Q", ",".join(worker_queues(settings)), "-c", str(concurrency),
                         "-n", f"farm@{settings.host_name}", "--without-gossip", "--without-mingle",
                         "-l", loglevel])
    finally:
        if notifier is not None:
            notifier.stop()


def notifier(
    concurrency: int = typer.Option(4, "--concurrency", "-c", min=1, help="Deliveries sent at once (threads)."),
    loglevel: str = typer.Option("info", "--loglevel", "-l", help="Celery log level."),
    beside: int = typer.Option(None, "--beside", hidden=True, help="The pid of the worker that started this one: "
                               "exit with it."),
):
    """Send notifications (queue notify) in a thread pool of their own. `farm worker` starts one
    beside itself; run this alone only on a host whose worker has --notify-concurrency 0."""
    from orchestrator.jobs.celery_app import make_celery, notifier_queues
    from orchestrator.services.stack import die_with_parent

    settings = cli_settings()
    if beside is not None and not die_with_parent(beside):
        could_not_run(f"the worker that started this notifier (pid {beside}) is gone")
    app = make_celery(settings)
    app.worker_main(["worker", "-Q", ",".join(notifier_queues()), "-P", "threads", "-c", str(concurrency),
                     "-n", f"notify@{settings.host_name}", "--without-gossip", "--without-mingle", "-l", loglevel])


def hub(
    https: bool = typer.Option(True, "--https/--no-https", help="Also serve devices on the network over HTTPS "
                               "(the farm's CA is made on first use: `farm ca export` for the devices)."),
    port: int = typer.Option(None, "--port", min=0, max=65535, help="Plain HTTP port on 127.0.0.1 (default: "
                             "hub_port, 8780; 0: any free one)."),
    https_port: int = typer.Option(None, "--https-port", min=0, max=65535, help="HTTPS port (default: "
                                   "hub_https_port, 8743; 0: any free one)."),
):
    """Run the hub browser devices talk to: HTTP on 127.0.0.1 (workers, phones' reverse forwards)
    and HTTPS for phones and tablets on the network (docs/phones.md). One per farm host;
    while it runs, <config_dir>/hub.json (0600) tells workers its key and ports."""
    import json

    from orchestrator.infra import ca
    from orchestrator.transports.hub import BrowserHub

    settings = cli_settings()
    port = settings.hub_port if port is None else port
    https_port = settings.hub_https_port if https_port is None else https_port
    tls = None
    if https:
        folder = ca.default_dir(settings.config_dir)
        try:
            ca.load_ca_cert(folder)
        except ca.NoCa:
            ca.init_ca(folder, f"devicefarm CA {settings.host_name}"[:64], names=settings.hub_cert_names())
            console.print(f"made the farm's CA in {folder}; install it on the devices: `farm ca export`",
                          highlight=False)
        except ca.CaError as exc:
            fail(str(exc))
        try:
            tls = (settings.hub_https_host, https_port, ca.server_ssl_context(folder, settings.hub_cert_names()))
        except ca.CaError as exc:
            fail(str(exc))
    try:
        running = BrowserHub("127.0.0.1", port, https=tls, tokens_dir=settings.browser_tokens_dir,
                             stores=settings.data_dir / "devices")
    except OSError as exc:
        could_not_run(f"cannot listen: {exc} (is another `farm hub` running? set hub_port / hub_https_port)")
    public = f"https://{settings.hub_public_host or settings.host_name}:{running.https_port}" if tls else None
    settings.config_dir.mkdir(parents=True, exist_ok=True)
    hub_file = settings.hub_file
    hub_file.unlink(missing_ok=True)
    with open(os.open(hub_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump({"key": running.key, "port": running.port, "https_port": running.https_port,
                   "public_url": public, "pid": os.getpid()}, f)
    console.print(f"hub listening on 127.0.0.1:{running.port}"
                  + (f" and {settings.hub_https_host}:{running.https_port} (devices open {public})" if tls else ""),
                  highlight=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        running.close()
        hub_file.unlink(missing_ok=True)


def beat(loglevel: str = typer.Option("info", "--loglevel", "-l", help="Celery log level.")):
    """Run Celery beat: fires the database's schedules (`farm schedules`) and sweeps stale jobs.
    Run one per farm (a second one fires nothing twice, but wastes work)."""
    from orchestrator.jobs.celery_app import make_celery

    settings = cli_settings()
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
    browser_phones: int = typer.Option(0, "--browser-phones", min=0, help="Virtual phones whose Chrome runs the "
                                       "engine (browser executor over adb)."),
    tablets: int = typer.Option(0, "--tablets", min=0, help="Virtual web devices (HTTPS through the hub)."),
):
    """Run the embedded stack until Ctrl-C: a worker, beat, the hub browser devices talk to and
    virtual phones, with this host's GPU as a device, and the devices registered on this host
    (`farm devices add`: a phone on USB, a tablet). Every process it started is stopped when it
    returns."""
    settings = cli_settings()
    with open_store(settings):
        pass
    with start_stack(settings, phones=phones, host_gpu=host_gpu, concurrency=concurrency, beat=True,
                     browser_phones=browser_phones, tablets=tablets, registered=True) as stack:
        try:  # the stop signal may land while the line below is still being written
            console.print(f"[bold green]farm up[/]: {len(stack.devices)} devices on host {settings.host_name} "
                          f"({', '.join(stack.devices)}); logs in {stack.stack.log_dir}. Ctrl-C stops everything.")
            while True:
                stack.stack.check_alive()
                time.sleep(1.0)
        except KeyboardInterrupt:
            console.print("stopping the stack")
        except Exception as exc:  # noqa: BLE001  (a child died: say which, then stop the rest)
            console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
            raise typer.Exit(COULD_NOT_RUN) from None


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _interrupt_on_stop_signals() -> dict:
    """SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread, as Ctrl-C does, so a
    stack ended by `kill`, a closed terminal or a CI time limit stops every process it started
    (their default action ends this process at once and leaves the hub, the phones, the worker
    and Chromium running). Returns the handlers to put back; none outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def interrupt(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    return {sig: signal.signal(sig, interrupt) for sig in STOP_SIGNALS}


def _stop(stack, handlers: dict) -> None:
    """Stop the stack with the stop signals held off (a second `kill` must not cut the stopping
    short), then put the caller's handlers back."""
    for sig in handlers:
        signal.signal(sig, signal.SIG_IGN)
    try:
        stack.stop()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


class RunningStack:
    """The embedded stack with its devices registered; `with` stops it."""

    def __init__(self, settings, stack, devices: list[str], handlers: dict | None = None):
        self.settings, self.stack, self.devices = settings, stack, devices
        self._handlers = handlers or {}

    def __enter__(self) -> RunningStack:
        return self

    def __exit__(self, *exc) -> None:
        with console.status("stopping worker, beat and phones"):
            _stop(self.stack, self._handlers)


HOST_GPU_SERIAL = "host-gpu"


def start_stack(settings, *, phones: int, host_gpu: bool, concurrency: int | None, beat: bool,
                browser_phones: int = 0, tablets: int = 0, registered: bool = False) -> RunningStack:
    """Start the hub, phones and tablets, register them (and the host GPU) as devices of this
    host, start the worker (and beat), probe every device; stops what it started when anything
    fails. `browser_phones`: virtual phones whose Chrome runs the engine (browser executor over
    adb); `tablets`: virtual web devices that open the hub over HTTPS themselves; `registered`:
    drive the real devices already registered on this host too (`registered_here`)."""
    from agent.bundle import provision_public_key
    from orchestrator.infra import ca
    from orchestrator.infra.keys import PUBLIC_KEY
    from orchestrator.jobs.celery_app import make_celery
    from orchestrator.services.stack import Stack, StackError
    from orchestrator.transports.adb import load_or_create_adb_key
    from orchestrator.transports.base import TransportError
    from orchestrator.transports.browser import enrolment_url

    from .builds import farm_key

    farm_key(settings.config_dir)
    public = settings.config_dir / PUBLIC_KEY
    stack = Stack(settings)
    handlers = _interrupt_on_stop_signals()
    try:
        entries = []  # (serial, transport, address, engine_host)
        with console.status("starting the hub browser devices talk to"):
            hub = stack.start_hub()
        if host_gpu:
            root = settings.data_dir / "devices" / HOST_GPU_SERIAL
            provision_public_key(root, public)
            entries.append((HOST_GPU_SERIAL, "local", str(root), "python"))
        if phones or browser_phones:
            # The phones ask for ADB authentication and know one host: the key the worker's adb
            # transport signs with, as a real phone knows the host it was paired with.
            adb_key = load_or_create_adb_key(settings.adb_key)
            adb_public = adb_key.with_name(adb_key.name + ".pub")
        with console.status(f"starting {phones + browser_phones} virtual phones"):
            for index in range(1, phones + 1):
                serial = f"vphone-{index}"
                _, port = stack.start_phone(serial, public, adb_public,
                                            model="Pixel 7" if index % 2 else "Galaxy S23 Ultra")
                entries.append((serial, "adb", f"127.0.0.1:{port}", "python"))
            for index in range(1, browser_phones + 1):
                serial = f"vphone-chrome-{index}"
                _, port = stack.start_phone(serial, public, adb_public, model="Pixel 7")
                entries.append((serial, "adb", f"127.0.0.1:{port}", "browser"))
        if tablets:
            from orchestrator.transports.hub import read_or_make_token

            ca_pem = ca.default_dir(settings.config_dir) / ca.CA_CERT
            with console.status(f"starting {tablets} virtual tablets"):
                for index in range(1, tablets + 1):
                    serial = f"vtablet-{index}"
                    token = read_or_make_token(settings.browser_tokens_dir / serial)
                    # The tablet is on this machine: it reaches the hub as localhost (a name
                    # the hub's certificate covers), as a lab device reaches the farm's name.
                    url = enrolment_url(f"https://localhost:{hub['https_port']}", serial, token, public, virtual=True)
                    stack.start_tablet(serial, url, ca_pem)
                    entries.append((serial, "web", "", "browser"))
        others = registered_here(settings, {entry[0] for entry in entries} | {HOST_GPU_SERIAL}) if registered else []
        if not entries and not others:
            fail("no devices: register one (farm devices add SERIAL --transport adb --address usb:SERIAL), "
                 "start virtual phones (--phones N) or keep the host GPU (--host-gpu)")
        if entries:
            register_devices(settings, entries)
        entries += [(serial, "", "") for serial in others]
        with console.status("starting the worker"):
            stack.start_worker(concurrency or len(entries))
            if beat:
                stack.start_beat()
            stack.wait_worker_ready(make_celery(settings))
        _probe_all(settings, [entry[0] for entry in entries])
    except (StackError, TransportError) as exc:
        _stop(stack, handlers)
        could_not_run(str(exc))
    except BaseException:
        _stop(stack, handlers)
        raise
    return RunningStack(settings, stack, [entry[0] for entry in entries], handlers)


def _probe_all(settings, serials: list[str]) -> None:
    from orchestrator import store

    from .devices import probe

    with open_store(settings) as sessions:
        with sessions() as session:
            devices = store.devices_named(session, serials)
        with console.status("probing devices"):
            for device in devices:
                outcome = probe(settings, sessions, device)
                if outcome["error"]:
                    console.print(f"[yellow]warning:[/] {escape(device.serial)}: {escape(outcome['error'])}", highlight=False)
