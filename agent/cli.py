"""`farm-agent`: the device-side command. `info` says what the device is, `install` checks and
installs a signed bundle (`resume` appends the chunks of a file pushed in pieces), `run` runs
one job (generate, latency, tune) and leaves its JobResult in the output folder, `serve` is
the network agent, `simulate` starts a virtual phone. The agent's root folder (builds, store,
locks, logs, farm.pub) comes from --root, else $FARM_AGENT_ROOT, else
~/.local/share/devicefarm-agent.

Exit codes of `run`: 0 the job succeeded, 1 it failed (the result says why), 2 bad input (a
malformed or unknown job document), 75 the device is busy with another job (EX_TEMPFAIL).
User errors print one `error: ...` line, never a traceback. Under the virtual phone
($FARM_AGENT_FS_ROOT, agent/fsroot.py) every path argument must lie in the phone's filesystem;
one that does not is bad input."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import typer

from agent.protocol import EXIT_BAD_INPUT, EXIT_BUSY, EXIT_FAILED
from engine.errors import EngineError

ROOT_ENV = "FARM_AGENT_ROOT"
DEFAULT_ROOT = Path("~/.local/share/devicefarm-agent")

app = typer.Typer(name="farm-agent", help="The devicefarm agent that runs on each device.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)

ROOT_OPTION = typer.Option(None, "--root", envvar=ROOT_ENV, help=f"Agent root folder (default: ${ROOT_ENV}, "
                           f"else {DEFAULT_ROOT}).", show_default=False)


def agent_root(root: Path | None) -> Path:
    return (root or DEFAULT_ROOT).expanduser()


def fail(message: str, code: int = EXIT_FAILED):
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def confined_paths(paths: dict[str, Path | str | None]):
    """The device's filesystem (agent/fsroot.py), after checking every named path against it:
    nothing is read or written before all of a command's paths are known to stay inside."""
    from agent.fsroot import FsRoot, PathRefused

    fs = FsRoot.from_env()
    try:
        for what, path in paths.items():
            if path is not None and str(path) != "-":
                fs.check(path, what)
    except PathRefused as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    return fs


@app.callback()
def _root():
    """The devicefarm agent that runs on each device."""


@app.command()
def info(as_json: bool = typer.Option(False, "--json", help="Print the DeviceInfo as JSON.")):
    """Report this device: model, OS, WebGPU adapter, temperatures, battery."""
    from agent.deviceinfo import collect_local, hottest_celsius
    from agent.protocol import to_json

    try:
        device = collect_local()
    except EngineError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(to_json(device))
        return
    a = device.adapter
    hottest = hottest_celsius(device)
    typer.echo(f"{device.model or 'unknown model'} ({device.manufacturer or 'unknown maker'}), "
               f"{device.os} {device.os_version}: {a.get('device')} ({a.get('backend')}, {a.get('adapter_type')})"
               + (f", hottest zone {hottest:.1f} C" if hottest is not None else ""))


@app.command()
def install(
    bundle_dir: Path = typer.Argument(..., help="Bundle folder: manifest.json, manifest.sig, files/."),
    root: Path = ROOT_OPTION,
    public_key: Path = typer.Option(None, help="The farm's public key (default: farm.pub in the root)."),
    allow_downgrade: bool = typer.Option(False, "--allow-downgrade",
                                         help="Make the build current even if it was built before the current one."),
):
    """Verify a signed bundle against the farm's key and install it as the current build (a
    build older than the current one is installed beside it, current only with --allow-downgrade)."""
    from agent.bundle import BundleError, install_bundle

    root = agent_root(root)
    confined_paths({"bundle folder": bundle_dir, "--root": root, "--public-key": public_key})
    if not bundle_dir.is_dir():
        fail(f"bundle folder {bundle_dir} does not exist", EXIT_BAD_INPUT)
    try:
        build = install_bundle(bundle_dir, root, public_key, allow_downgrade=allow_downgrade)
    except (BundleError, OSError) as exc:
        fail(f"install refused: {exc}")
    where = f"{len(build.manifest.files)} files) at {build.path}"
    if build.kept_current:
        typer.echo(f"installed build {build.build_id} ({where}; not made current: it is older than the current "
                   f"build {build.kept_current} (--allow-downgrade makes it current)")
    else:
        typer.echo(f"installed build {build.build_id} ({where}; now current")


@app.command()
def resume(
    staging: Path = typer.Argument(..., help="The staged bundle folder; its manifest.json and manifest.sig first."),
    root: Path = ROOT_OPTION,
    check: bool = typer.Option(False, "--check", help="Hash each partial upload again first (a deploy's start)."),
):
    """Append the chunk files pushed beside each partial upload of a staged build (<root>/
    incoming/.resume/<sha>.<index>), each checked against the signed manifest; a file made
    whole moves into the staged folder. Prints {"held": {sha256: bytes}} as JSON."""
    from agent.bundle import BundleError
    from agent.uploads import absorb_chunks

    root = agent_root(root)
    confined_paths({"staged folder": staging, "--root": root})
    try:
        held = absorb_chunks(staging, root, check=check)
    except (BundleError, OSError) as exc:
        fail(f"resume refused: {exc}")
    typer.echo(json.dumps({"held": held}))


@app.command()
def verify(
    build_id: str = typer.Argument(None, help="The installed build to check (default: the current one)."),
    root: Path = ROOT_OPTION,
):
    """Hash an installed build's files against its signed manifest; exit 0 when all are intact."""
    from agent.bundle import current_build, list_builds, verify_build

    root = agent_root(root)
    confined_paths({"--root": root})
    builds = [current_build(root)] if build_id is None else [b for b in list_builds(root) if b.build_id == build_id]
    if not builds or builds[0] is None:
        fail(f"no build {build_id or 'current'} is installed under {root / 'builds'}", EXIT_BAD_INPUT)
    damaged = verify_build(root, builds[0])
    if damaged:
        fail(f"build {builds[0].build_id}: {len(damaged)} damaged or missing file(s): {', '.join(damaged[:10])}"
             + (" ..." if len(damaged) > 10 else "") + "; deploy it again")
    typer.echo(f"build {builds[0].build_id}: {len(builds[0].manifest.files)} files intact")


def _read_spec(job: str):
    from agent.protocol import JobSpec, ProtocolError, from_json

    try:
        text = sys.stdin.read() if job == "-" else Path(job).read_text()
    except OSError as exc:
        fail(f"cannot read job file {job}: {exc.strerror or exc}", EXIT_BAD_INPUT)
    try:
        return from_json(JobSpec, text)
    except ProtocolError as exc:
        fail(str(exc), EXIT_BAD_INPUT)


@app.command()
def run(
    job: str = typer.Argument(..., help="JobSpec JSON file ('-': standard input)."),
    out: Path = typer.Option(..., "--out", help="Output folder: result.json, job.log, artifacts."),
    root: Path = ROOT_OPTION,
    quiet: bool = typer.Option(False, "--quiet", help="No progress lines on stderr."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole JobResult as JSON."),
):
    """Run one job on this device; progress is one JSON object per line on stderr."""
    from agent.jobs import AgentBusy, Interrupted, run_job
    from agent.protocol import to_json

    fs = confined_paths({"job file": job, "--out": out, "--root": agent_root(root)})
    spec = _read_spec(job)

    def progress(event: dict) -> None:
        if not quiet:
            sys.stderr.write(json.dumps(event, default=str) + "\n")
            sys.stderr.flush()

    def on_term(signum, frame):
        raise Interrupted(f"the agent received signal {signum}")

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, on_term)  # so the child dies and the lock is freed
    try:
        result = run_job(spec, out, agent_root(root), progress=progress, fs=fs)
    except AgentBusy as exc:
        fail(str(exc), EXIT_BUSY)
    except Interrupted as exc:  # arrived outside the child's run: the lock is released all the same
        fail(f"job interrupted: {exc}")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if as_json:
        typer.echo(to_json(result))
    else:
        typer.echo(f"{result.status}: job {result.job_id} ({result.kind}) -> {Path(out) / 'result.json'}")
        if result.error:
            typer.echo(f"error: {result.error}")
    raise typer.Exit(0 if result.status == "succeeded" else EXIT_FAILED)


@app.command()
def stop(
    job_id: str = typer.Argument(..., help="The running job's id (its JobSpec's job_id)."),
    root: Path = ROOT_OPTION,
    reason: str = typer.Option("stopped by the farm", "--reason", help="Recorded as the job's error."),
):
    """Stop a running job: its process is killed and it ends failed with the reason. Exit 0 when
    it was running, 1 when it is not (already ended, or another job runs)."""
    from agent.jobs import stop_job

    root = agent_root(root)
    confined_paths({"--root": root})
    if not stop_job(root, job_id, reason):
        fail(f"job {job_id} is not running on this device")
    typer.echo(f"job {job_id} stopped: {reason}")


@app.command()
def serve(
    port: int = typer.Option(8765, help="TCP port to listen on."),
    token_file: Path = typer.Option(..., help="File holding the bearer token clients must send (mode 600)."),
    root: Path = ROOT_OPTION,
    host: str = typer.Option("127.0.0.1", help="Address to listen on; 0.0.0.0 for every interface (use "
                             "--tls-cert/--tls-key then: the token crosses the network)."),
    tls_cert: Path = typer.Option(None, help="PEM certificate (chain) to serve HTTPS with."),
    tls_key: Path = typer.Option(None, help="PEM private key of --tls-cert."),
    idle_timeout: float = typer.Option(30.0, min=0.1, help="Seconds a connection may stay silent before "
                                       "it is closed."),
):
    """Serve this device to the farm over HTTP(S) (for devices not reached through ADB)."""
    from agent.serve import ServeError
    from agent.serve import serve as run_server

    try:
        run_server(agent_root(root), token_file, host=host, port=port, tls_cert=tls_cert, tls_key=tls_key,
                   idle_timeout_s=idle_timeout)
    except ServeError as exc:
        fail(str(exc))


@app.command("simulate-tablet")
def simulate_tablet(
    url_file: Path = typer.Option(..., "--url-file", help="A file holding the farm's enrolment URL (farm "
                                  "devices enrol SERIAL); it carries the device's token, which a command "
                                  "line would show to every user of the machine.", exists=True, dir_okay=False),
    ca: Path = typer.Option(..., "--ca", help="The farm's CA certificate (PEM) the tablet trusts."),
    root: Path = typer.Option(..., "--root", help="Folder for the tablet's browser profile."),
):
    """Run a virtual web device until SIGTERM: headless Chromium, trusting the farm's CA, on the
    enrolment URL."""
    url = url_file.read_text().strip()
    try:
        from agent.simulator.tablet import TabletError, VirtualTablet
    except ImportError as exc:
        fail(f"the virtual tablet is not available in this build ({exc})")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with VirtualTablet(root, ca) as tablet:
            tablet.open(url)
            typer.echo(f"virtual tablet on {url.split('#', 1)[0]}")
            while not stop.wait(1.0):
                if not tablet.running:  # its browser died: a person would open the page again
                    tablet.open(url)
    except TabletError as exc:
        fail(str(exc))


@app.command()
def simulate(
    port: int = typer.Option(..., help="TCP port the virtual phone's adbd listens on."),
    serial: str = typer.Option(..., help="The phone's serial number."),
    model: str = typer.Option("Pixel 7", help="Phone model to imitate."),
    root: Path = typer.Option(None, help="Folder for the phone's sandboxed filesystem."),
    auth: bool = typer.Option(True, "--auth/--no-auth", help="Require RSA authentication, like a real phone "
                              "(--no-auth: anyone who reaches the port gets a shell)."),
    adb_keys: Path = typer.Option(None, "--adb-keys", help="Host ADB public keys (adbkey.pub) the phone accepts, "
                                  "read at each connection."),
    accept_new_keys: bool = typer.Option(False, "--accept-new-keys", help="Accept any host's key on first "
                                         "connection, as if 'Allow' were tapped on the phone."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    trust: Path = typer.Option(None, help="Farm public key (farm.pub) to provision on the phone, so it "
                               "accepts that farm's signed builds (provisioned when the file appears)."),
):
    """Run a virtual phone that speaks ADB, with this host's real WebGPU adapter."""
    try:
        from agent.simulator import run_simulator
        from agent.simulator.phone import auth_note
    except ImportError as exc:
        fail(f"the virtual phone is not available in this build ({exc})")
    if adb_keys is not None and not auth:
        fail(f"--adb-keys {adb_keys} needs --auth: a phone without authentication lets every host in")
    try:
        if trust is not None and not trust.is_file():
            typer.echo(f"{trust} does not exist yet: builds are refused until it does", err=True)
        if auth and adb_keys is not None and not adb_keys.is_file():
            typer.echo(f"{adb_keys} does not exist yet: hosts are refused until it does", err=True)
        run_simulator(port, serial, model=model, root=root, auth=auth, host=host, trust=trust, adb_keys=adb_keys,
                      accept_new_keys=accept_new_keys,
                      ready=lambda bound: typer.echo(f"virtual phone {serial} ({model}) listening on {host}:{bound}"
                                                     f"{auth_note(auth, adb_keys, accept_new_keys)}"))
    except KeyboardInterrupt:
        pass
    except (ValueError, OSError) as exc:
        fail(str(exc))


def main() -> None:
    try:
        app()
    except EngineError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_FAILED)


if __name__ == "__main__":  # `python -m agent.cli`: how the virtual phone and bundles run the agent
    main()
