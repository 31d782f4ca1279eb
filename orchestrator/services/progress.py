"""Watching long work: what deploys, checks, suites (`farm jobs submit --wait`), bisect steps and
the demo share while they wait on workers. One loop (`watch`) polls the store for each
device's piece of work (a `Step`: a deployment or a job, its state, its bytes), reports what
changed, reminds every `remind_s` that it is still waiting and on what, and notices within
seconds when no worker consumes the queue the work went to: every worker stamps the hosts
whose queues it consumes as heard (hosts.last_seen, every health.host_beat_s), so a host not
heard for a few beats has none. Whether the caller then stops (`no_worker_s`) or keeps waiting
is the caller's choice; the watcher says which. What it reports is data (`Progress`): the CLI
draws it as a live table on a terminal and as plain lines anywhere else, the API keeps its
line; nothing here prints."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from orchestrator import store
from orchestrator.infra.settings import Settings
from orchestrator.jobs.celery_app import host_queue
from orchestrator.jobs.health import host_beat_s
from orchestrator.store import Session
from orchestrator.store.models import Deployment, Job

REMIND_S = 30.0  # a watcher says it is still waiting at least this often, piped or not
NO_WORKER_S = 45.0  # what `farm check` waits for a worker to appear before it ends "could not run"
POLL_S = 0.5
HEARD_BEATS = 3  # a host missing this many of its workers' beats (plus a second) has no worker
ENDED = frozenset({"succeeded", "failed", "infra_failed", "cancelled"})
START_WORKER = "`farm worker --host {host}` on that host (or `farm up` on this one)"


@dataclass(frozen=True)
class Step:
    """One device's piece of watched work: a deployment or a job."""

    device: str
    what: str  # "deploy b2", "latency job 12"
    state: str  # queued, pending, running, succeeded, failed, infra_failed, cancelled
    host: str | None = None  # whose queue it went to (None: not known, never called silent)
    heard: dt.datetime | None = None  # that host's last_seen, as read with the step
    sent: int | None = None  # bytes, for a deployment
    total: int | None = None
    note: str = ""  # a running job's phase ("unet_step 4/10"), an error

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def mark(self) -> tuple:
        """What makes a new line when it changes: the state, the note, and for bytes each tenth."""
        tenth = None if not self.total or self.sent is None else min(10, 10 * self.sent // self.total)
        return self.state, self.note, tenth

    def text(self) -> str:
        """"vphone-1: deploy b2 running, 12.0 / 40.0 MiB"."""
        out = f"{self.device}: {self.what} {self.state}"
        if self.sent is not None and (self.sent or self.total):
            out += f", {mib(self.sent)}" + (f" / {mib(self.total)}" if self.total else "")
        return out + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class Silence:
    """A host whose queue holds watched work that no worker consumes."""

    host: str
    heard: dt.datetime | None  # when a worker (or a registration) last stamped it

    def text(self, now: dt.datetime) -> str:
        heard = "never heard" if self.heard is None else f"last heard {ago(now - self.heard)} ago"
        return (f"no worker is consuming queue '{host_queue(self.host)}' ({heard}): start one with "
                + START_WORKER.format(host=self.host))


@dataclass
class Progress:
    """What a watcher reports: every step, those that changed since the last report, the hosts
    nobody serves, and why it reports now ("change", "remind", "silence", "end", or "poll":
    nothing to say, but a live view may refresh its clock)."""

    steps: list[Step]
    changed: list[Step]
    silent: list[Silence]
    elapsed_s: float
    why: str
    now: dt.datetime = field(default_factory=store.utcnow)
    waiting_on: str = ""  # set with `silent`: what the watcher does about it ("waiting", "stopping ...")

    def counts(self) -> str:
        """"2/6 done, 1 running, 3 queued" ("done": ended, whatever the outcome)."""
        ended = sum(s.ended for s in self.steps)
        states: dict[str, int] = {}
        for s in self.steps:
            if not s.ended:
                states[s.state] = states.get(s.state, 0) + 1
        return ", ".join([f"{ended}/{len(self.steps)} done"] + [f"{n} {state}" for state, n in states.items()])

    def reminder(self) -> str:
        """The periodic line: "still waiting after 90 s: 2/6 done, 4 queued"."""
        return f"still waiting after {self.elapsed_s:.0f} s: {self.counts()}"

    def silence_lines(self) -> list[str]:
        return [s.text(self.now) + (f"; {self.waiting_on}" if self.waiting_on else "") for s in self.silent]


@dataclass
class Ending:
    """How a watch ended: "done", "timeout" or "no_worker", with the last steps and silence."""

    reason: str
    steps: list[Step]
    silent: list[Silence]
    elapsed_s: float
    now: dt.datetime = field(default_factory=store.utcnow)

    @property
    def done(self) -> str:
        """"3/6 jobs done"-style count of the steps that ended, whatever their outcome."""
        return f"{sum(s.ended for s in self.steps)}/{len(self.steps)}"

    def why(self) -> str:
        """The reason in words, for an error line or a report."""
        if self.reason == "no_worker":
            return "; ".join(s.text(self.now) for s in self.silent)
        if self.reason == "timeout":
            return f"time ran out after {self.elapsed_s:.0f} s"
        return "done"


def heard_within_s(settings: Settings) -> float:
    """A host stamped longer ago than this has no worker: its workers stamp it every
    health.host_beat_s, and one beat may miss (a busy store)."""
    return HEARD_BEATS * host_beat_s(settings) + 1.0


def silent_hosts(steps: Iterable[Step], settings: Settings, now: dt.datetime) -> list[Silence]:
    """The hosts of the unfinished steps that no worker has stamped for heard_within_s."""
    limit = dt.timedelta(seconds=heard_within_s(settings))
    silent = {}
    for s in steps:
        if s.ended or s.host is None or s.host in silent:
            continue
        heard = None if s.heard is None else _aware(s.heard)
        if heard is None or now - heard > limit:
            silent[s.host] = Silence(s.host, heard)
    return [silent[h] for h in sorted(silent)]


def watch(
    sessions: Callable[[], Session],
    settings: Settings,
    read: Callable[[Session], list[Step]],
    report: Callable[[Progress], None],
    *,
    done: Callable[[Session, list[Step]], bool] | None = None,
    timeout_s: float | None = None,
    no_worker_s: float | None = None,
    poll_s: float = POLL_S,
    remind_s: float = REMIND_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Ending:
    """Poll `read` (a short session each time) until every step has ended (or `done` says so),
    `timeout_s` passes, or, with `no_worker_s`, a host the work waits on has had no worker for
    that long; `report` hears every poll: each change, a reminder every `remind_s` without one,
    each change in which hosts are silent (saying whether the watch waits on or will stop), and
    "poll" otherwise. `read` may raise to end the watch (a check's failed job)."""
    started = clock()
    marks: dict[tuple[str, str], tuple] = {}
    silent_since: dict[str, float] = {}
    said_silent: frozenset[str] = frozenset()
    last_report = started
    while True:
        with sessions() as session:
            steps = read(session)
            finished = done(session, steps) if done is not None else all(s.ended for s in steps)
        now, at = store.utcnow(), clock()
        elapsed = at - started
        changed = [s for s in steps if marks.get((s.device, s.what)) != s.mark()]
        marks = {(s.device, s.what): s.mark() for s in steps}
        silent = [] if finished else silent_hosts(steps, settings, now)
        silent_since = {s.host: silent_since.get(s.host, at) for s in silent}
        if finished:
            report(Progress(steps, changed, [], elapsed, "end", now))
            return Ending("done", steps, [], elapsed, now)
        waiting = "waiting for one" if no_worker_s is None else \
            f"giving up in {max(0.0, no_worker_s - (at - min(silent_since.values(), default=at))):.0f} s"
        if silent and no_worker_s is not None and at - min(silent_since.values()) >= no_worker_s:
            report(Progress(steps, changed, silent, elapsed, "end", now, "could not run"))
            return Ending("no_worker", steps, silent, elapsed, now)
        if timeout_s is not None and elapsed >= timeout_s:
            report(Progress(steps, changed, silent, elapsed, "end", now))
            return Ending("timeout", steps, silent, elapsed, now)
        heard_now = frozenset(s.host for s in silent)
        why = ("silence" if heard_now - said_silent else "change" if changed
               else "remind" if at - last_report >= remind_s else "poll")
        said_silent = heard_now
        report(Progress(steps, changed, silent, elapsed, why, now, waiting))
        if why != "poll":
            last_report = at
        sleep(poll_s)


def lines(p: Progress) -> list[str]:
    """A report as plain lines (a pipe, a log, the API's progress): each change, the silent
    hosts when that changes and with each reminder, and the reminder."""
    out = [s.text() for s in p.changed]
    if p.silent and p.why in ("silence", "remind"):
        out += p.silence_lines()
    if p.why == "remind":
        out.append(p.reminder())
    return out


# ---- what the verbs watch -----------------------------------------------------------------


def _host_of(device) -> tuple[str | None, dt.datetime | None]:
    host = device.host
    return (None, None) if host is None else (host.name, host.last_seen)


def job_steps(jobs: Sequence[Job]) -> list[Step]:
    """A step per job: "latency job 12", its state, its phase while it runs, its error once ended."""
    out = []
    for job in jobs:
        host, heard = _host_of(job.device)
        note = ""
        if job.error and str(job.state) != "queued":
            note = job.error.splitlines()[0][:80]
        elif str(job.state) == "running" and job.progress and job.progress.get("phase"):
            p = job.progress
            note = p["phase"] + (f" {p['done']}/{p['total']}" if p.get("total") else "")
        out.append(Step(job.device.serial, f"{job.kind} job {job.id}", str(job.state), host, heard, note=note))
    return out


def deployment_steps(deployments: Sequence[Deployment], devices: dict[int, str],
                     session: Session, build: str) -> list[Step]:
    """A step per device of `devices` (id -> serial): its deployment of `build` ("pending"
    until one is recorded), with the bytes sent."""
    by_device = {d.device_id: d for d in deployments}
    out = []
    for device_id, serial in devices.items():
        dep = by_device.get(device_id)
        host, heard = _host_of(store.get_device(session, serial))
        if dep is None:
            out.append(Step(serial, f"deploy {build}", "pending", host, heard, sent=0))
            continue
        out.append(Step(serial, f"deploy {build}", str(dep.status), host, heard, sent=dep.bytes_sent,
                        total=dep.bytes_total, note=(dep.error or "").splitlines()[0][:80] if dep.error else ""))
    return out


def batch_steps(session: Session, batch_ids: Sequence[int]) -> list[Step]:
    """The jobs of batches, as steps."""
    return job_steps(store.jobs_of_batches(session, list(batch_ids)))


# ---- words --------------------------------------------------------------------------------


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def ago(delta: dt.timedelta) -> str:
    """"12 s", "5 min", "2 h", "3 d"."""
    s = max(0.0, delta.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit}"
    return f"{s:.0f} s"


def _aware(value: dt.datetime) -> dt.datetime:
    """SQLite gives back naive datetimes; the store writes UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
