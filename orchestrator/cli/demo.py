"""`farm demo`: the whole farm on one machine with no configuration. It migrates the store,
makes a tiny random-weight model, packs two signed builds of this checkout (A: kernels chosen
per GPU by the shipped profiles; B: every reference kernel, so truly slower), starts the
embedded stack (worker, beat, the hub, virtual phones reached over ADB, one whose Chrome runs the
engine, a virtual tablet that opens the hub over HTTPS, this host's GPU as a device),
and for A then B deploys the build to every device and runs a latency suite and a generation
on each through Celery (generations in parallel; the latency jobs one at a time, because the
devices share this machine's GPU); each batch's analysis compares it with the series'
baseline, and an inconclusive comparison gets up to DEMO_EXTRA_ROUNDS more-repetitions rounds.
It prints a table per device and build, each verdict with the rounds it needed, the alerts B
raised, builds the HTML
dashboard, and stops every process it started. A second run makes new builds: the devices
receive only the files they lack."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import typer

from engine.kernels import PRECISIONS

from . import labels, numbers
from .common import COULD_NOT_RUN, cli_settings, fail
from .output import Table, console, escape, field

DEMO_PREFIX = "demo "
# The whole demo. Its runs took 357-515 s on one 2-core machine; on another of the same kind,
# whose lavapipe runs a UNet step 4.5x slower (AMD EPYC, AVX2), build A alone took 340 s and a
# run beside other work passed 900 s: a limit for a hang, not a pace.
TIMEOUT_S = 2400.0
POLL_S = 0.5
# A virtual phone heats toward 75 C under load (30 s time constant) and cools with a 60 s one:
# waiting for 65 C between jobs shows real cool-down waits without the timeouts that would flag
# (and exclude from the comparison) its runs.
COOLDOWN = {"max_celsius": 65.0, "max_wait_s": 60.0, "poll_s": 1.0}
# The demo's devices share this machine's CPU cores (lavapipe), so one run differs from the next
# by more than the default 3%: the same build measured twice here came out 6.6% apart (a
# false alert in the acceptance test). Its series get a 15% minimum effect, the per-series
# setting the analysis has for noisy series; the reference build is 2-3x slower.
DEMO_MIN_EFFECT = 0.15
# For the same reason a whole run sits above or below the next: the same build's runs on the
# demo's devices had log medians 6.4-11.2% apart (standard deviation, 3-11 runs a device:
# docs/benchmarks/2026-11-27-cpu-demo-verdicts.json). With the analysis' default 1% drift, two
# runs of A 23% apart were called a regression; the demo's series assume 10% until their own
# history (6 runs) estimates it. B, 2-7x slower, is still decided on its first run.
DEMO_DRIFT = 0.10
# An inconclusive comparison gets up to this many more-repetitions rounds (a new run of the
# candidate and of its baseline on that device, with the repetitions the analysis asks for);
# the output says how many rounds each verdict needed.
DEMO_EXTRA_ROUNDS = 2
# The metrics the demo's verdicts are about: each gets its more-repetitions rounds.
DEMO_ROUND_METRICS = ["unet_step_ms", "e2e_ms"]
ADD_BROWSERS = "bash scripts/ensure-chromium.sh"  # the one command that adds the browser devices


def demo_jobs(precision: str, steps: int) -> list[dict[str, Any]]:
    """The demo's suite: a latency job (5 generations and 5 UNet steps timed: the fewest the
    analysis decides on, 5 against 5 reaching p = 0.008; one profiled step for where the time
    went), then a generation."""
    from orchestrator.analysis.stats.compare import MIN_SAMPLES

    common = {"precision": precision, "steps": steps, "seed": 0, "cooldown": COOLDOWN, "time_limit_s": TIMEOUT_S,
              "prompt": "a red bicycle leaning on a wall"}
    # Five end-to-end generations: the fewest the analysis decides on (fewer would make every
    # e2e comparison inconclusive and ask for a more-repetitions round each time). The verdicts
    # are on the timed steps; the per-kernel times only say which kernels moved, and B's moved
    # 3-5x: one profiled step says it (five cost build B's browser devices 23 s of the demo's
    # 274 s at speed index 133 ms).
    timed = {"warmup": 1, "repetitions": MIN_SAMPLES, "unet_repetitions": MIN_SAMPLES, "kernel_repetitions": 1}
    # The generations make the images; the per-kernel times come from the latency jobs (the
    # attribution of each verdict), so a generation profiles no UNet step after it: in the
    # browser pages that step and its warm-up are two more UNet calls (2.3 s each of build B's
    # in SwiftShader).
    untimed = {"kernel_timings": False}
    python = [{"kind": "latency", "spec": common | timed},
              {"kind": "generate", "spec": common | untimed}]
    # The browser devices' pages run on Chromium's software adapter (SwiftShader), 4-5x slower
    # than lavapipe per UNet step here: their generations have one step, and they time 5 UNet
    # steps and 5 generations, the fewest the analysis decides on (5 against 5 reaches p =
    # 0.008), so the demo stays minutes. Smaller images would not do: at 32x32 the reference
    # kernels were only 1.1-1.2x slower in the page (per-dispatch costs dominate), too close
    # to tell from the page's noise.
    light = common | {"steps": 1}
    browser = [{"kind": "latency", "spec": light | timed},
               {"kind": "generate", "spec": light | untimed}]
    return [*({**j, "engine_host": "python"} for j in python), *({**j, "engine_host": "browser"} for j in browser)]


def demo(
    phones: int = typer.Option(1, "--phones", min=0, help="Virtual phones to start (farm-agent on the phone)."),
    browser_phones: int = typer.Option(1, "--browser-phones", min=0, help="Virtual phones whose Chrome runs the "
                                       "engine (the browser executor over adb: a reverse forward and am start)."),
    tablets: int = typer.Option(1, "--tablets", min=0, help="Virtual web devices that open the farm's hub over "
                                "HTTPS themselves (headless Chromium trusting the farm's CA)."),
    precision: str = typer.Option("fp32", "--precision", help="fp32, fp16 or f16-storage (packed halves where an adapter lacks shader-f16)."),
    steps: int = typer.Option(2, "--steps", min=1, help="Denoising steps per generation."),
    timeout: float = typer.Option(TIMEOUT_S, "--timeout", help="Give up after this many seconds."),
):
    """Run the farm end to end on this machine: build, deploy, measure, report."""
    from orchestrator.jobs.celery_app import make_celery
    from orchestrator.jobs.jobservice import launch_suite
    from orchestrator.store import make_engine, make_session_factory, upgrade

    from .builds import make_build
    from .stack import start_stack

    if precision not in PRECISIONS:
        fail(f"unknown precision {precision!r}; choose {', '.join(PRECISIONS)}")
    started = time.monotonic()
    browser_phones, tablets = _browser_devices(browser_phones, tablets)
    settings = cli_settings()
    from .builds import farm_key

    farm_key(settings.config_dir, announce=False)  # the demo installs it on its own devices
    with console.status("migrating the store"):
        upgrade(settings.database_url)
    model = settings.data_dir / "models" / "tiny"
    if not (model / "model_index.json").is_file():
        from engine.make_model import make_model

        with console.status("making a tiny random-weight model"):
            make_model("tiny", 0, model)
    from engine.speed import describe, measure

    with console.status("measuring this machine's speed index (the tiny model's UNet step)"):
        # what the demo's times follow: on software GPUs they differ 4.5x between machines
        console.print(describe(measure(model)), highlight=False, soft_wrap=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    label_a, label_b = demo_labels(settings)
    builds = [make_build(settings, model, name=f"demo-{stamp}-a", label=label_a),
              make_build(settings, model, name=f"demo-{stamp}-b", default_profile="reference", label=label_b)]
    for build, what in zip(builds, ("kernels chosen per GPU", "every reference kernel"), strict=True):
        console.print(f"build [bold]{build['label']}[/] = {build['name']} ({what}): {build['file_count']} files, "
                      f"{build['bytes'] / 1e6:.1f} MB", highlight=False)
    engine = make_engine(settings.database_url)
    sessions = make_session_factory(engine)
    ok, batches = True, []
    try:
        with start_stack(settings, phones=phones, host_gpu=True, concurrency=None, beat=True,
                         browser_phones=browser_phones, tablets=tablets) as running:
            console.print(f"stack up: {', '.join(running.devices)} (logs in {running.stack.log_dir})",
                          highlight=False)
            _set_series(sessions, running.devices, builds[0]["name"], demo_jobs(precision, steps))
            for build in builds:
                batch_id = launch_suite(make_celery(settings), f"{DEMO_PREFIX}{build['name']}",
                                        demo_jobs(precision, steps), build=build["name"], devices=running.devices,
                                        max_extra_rounds=DEMO_EXTRA_ROUNDS, round_metrics=DEMO_ROUND_METRICS)
                batches.append(batch_id)
                ok = _follow(sessions, settings, batch_id, build["name"], running, started + timeout) and ok
                console.print()
        _report(sessions, batches)
        _dashboard(settings)
    finally:
        engine.dispose()
    console.print(f"demo finished in {time.monotonic() - started:.0f} s; every process it started has stopped",
                  highlight=False)
    if not ok:  # a job or deployment failed: the demo could not run to its end
        raise typer.Exit(COULD_NOT_RUN)


def _browser_devices(browser_phones: int, tablets: int) -> tuple[int, int]:
    """The browser devices this machine can run: none without Chromium, no tablet without
    certutil (it trusts the farm's CA through NSS). What is left out is said in one line with
    the command that adds it; the rest of the demo runs as ever."""
    import os
    import shutil

    from engine.browser import find_chromium

    configured = os.environ.get("FARM_CHROMIUM")  # as the phone's Chrome and the tablet look it up
    chromium = shutil.which(configured) if configured else find_chromium()
    missing = None if chromium else "Chromium"
    left_out = [f"vphone-chrome-{i}" for i in range(1, browser_phones + 1)] if missing else []
    if tablets and not missing and not shutil.which("certutil"):
        missing = "certutil (libnss3-tools)"
    if missing:
        left_out += [f"vtablet-{i}" for i in range(1, tablets + 1)]
    if left_out:
        console.print(f"[yellow]no {missing} on this machine:[/] the demo runs without {', '.join(left_out)} "
                      f"(the browser executor); `{ADD_BROWSERS}` adds them", highlight=False, soft_wrap=True)
        return (0 if not chromium else browser_phones), 0
    return browser_phones, tablets


def _set_series(sessions, serials: list[str], build: str, jobs: list[dict[str, Any]]) -> None:
    """DEMO_MIN_EFFECT and DEMO_DRIFT on every series the demo's latency jobs feed, on every
    device."""
    from orchestrator import store
    from orchestrator.analysis import regressions

    with sessions() as session:
        model = store.default_model(store.get_build(session, build))
        for serial in serials:
            device = store.get_device(session, serial)
            for job in jobs:
                if job["kind"] != "latency" or job.get("engine_host") not in (None, device.engine_host):
                    continue
                spec = regressions.SpecKey.of({"model": model} | job["spec"])
                for metric in regressions.HEADLINE_METRICS:
                    key = regressions.series_key(device, spec, metric)
                    regressions.set_min_effect(session, key, DEMO_MIN_EFFECT)
                    regressions.set_drift(session, key, DEMO_DRIFT)
        session.commit()


def batch_family(session, root_id: int) -> tuple[list, bool]:
    """A batch and its more-repetitions rounds (ordered by round), and whether every round
    its analyses asked for has been launched and analysed."""
    from orchestrator import store
    from orchestrator.store.batches import extra_round

    root = store.get_batch(session, root_id)
    rounds = store.extra_rounds_of(session, root_id)
    family = [root, *sorted(rounds, key=lambda b: (extra_round(b.idempotency_key), b.id))]
    keys = {b.idempotency_key for b in rounds}
    done = all(b.summary is not None for b in family)
    for batch in family:
        if batch.summary is None:
            continue
        n = extra_round(batch.idempotency_key)
        if n >= batch.max_extra_rounds:
            continue
        for entry in batch.summary.get("analysis", {}).get("more_repetitions", []):
            done = done and f"more:{root_id}:{n + 1}:{entry['device']}" in keys
    return family, done


def _follow(sessions, settings, batch_id: int, build: str, running, deadline: float) -> bool:
    """Deployments and job states until the batch and its more-repetitions rounds are analysed,
    through the shared watch (orchestrator/services/progress.py): this table live on a
    terminal, a line per change when piped; False when a job did not succeed or time ran out."""
    from orchestrator import store
    from orchestrator.services import progress as watched
    from orchestrator.store.batches import extra_round

    from .watching import Reporter

    seen: dict[str, Any] = {"table": None, "done": False, "ok": False}

    def read(session) -> list[watched.Step]:
        running.stack.check_alive()
        family, done = batch_family(session, batch_id)
        devices = {d.id: d.serial for d in store.devices_named(session, running.devices)}
        deployments = store.deployments_of_batch(session, batch_id)
        by_device = {d.device_id: d for d in deployments}
        jobs = store.jobs_of_batches(session, [b.id for b in family])
        table = Table("device", "deploy", "sent", "files sent / already there", "latency", "generate",
                      "more repetitions", title=f"batch {batch_id}")
        for device_id, serial in sorted(devices.items(), key=lambda kv: kv[1]):
            dep = by_device.get(device_id)
            states = {str(j.kind): str(j.state) for j in jobs if j.device_id == device_id
                      and j.batch_id == batch_id}
            extra = [f"round {extra_round(b.idempotency_key)}: "
                     f"{sum(str(j.state) == 'succeeded' for j in jobs if j.batch_id == b.id)}/"
                     f"{sum(j.batch_id == b.id for j in jobs)} done"
                     for b in family[1:] if b.idempotency_key.endswith(f":{serial}")]
            table.add_row(serial, str(dep.status) if dep else "queued",
                          f"{dep.bytes_sent / 2**20:.1f} MiB" if dep else "-",
                          f"{dep.files_sent} / {dep.files_skipped}" if dep else "-",
                          states.get("latency", "-"), states.get("generate", "-"), ", ".join(extra) or "-")
        seen.update(table=table, done=done, ok=all(str(j.state) == "succeeded" for j in jobs))
        return watched.deployment_steps(deployments, devices, session, build) + watched.job_steps(jobs)

    with Reporter(f"batch {batch_id}", view=lambda p: seen["table"]) as reporter:
        ending = watched.watch(sessions, settings, read, reporter, done=lambda s, _: seen["done"],
                               timeout_s=max(0.0, deadline - time.monotonic()), poll_s=POLL_S)
    if ending.reason != "done":
        console.print("[bold red]error:[/] the demo ran out of time; the stack's logs are in "
                      f"{running.stack.log_dir}", highlight=False)
        return False
    return seen["ok"]


def final_verdicts(family) -> list[dict[str, Any]]:
    """Each (device, metric) comparison of a batch family as its last round left it, with
    `rounds`: how many rounds (the batch itself, then its more-repetitions rounds) it took."""
    from orchestrator.store.batches import extra_round

    final: dict[tuple[str, str], dict[str, Any]] = {}
    for batch in family:
        if batch.summary is None:
            continue
        for c in batch.summary.get("analysis", {}).get("comparisons", []):
            final[(c["device"], c.get("metric", "-"))] = c | {"rounds": extra_round(batch.idempotency_key) + 1}
    return [final[k] for k in sorted(final)]


def demo_labels(settings) -> tuple[str, str]:
    """The labels of this run's two builds: A and B, or, where an earlier run's builds have
    them, the first free of A2, A3... and B2, B3... (labels are unique)."""
    from orchestrator import store

    from .common import open_store

    with open_store(settings) as sessions, sessions() as session:
        return store.free_label(session, "A"), store.free_label(session, "B")


def _report(sessions, batch_ids: list[int]) -> None:
    """A table per build (a row per device) and the images' paths, then what each batch's
    analysis found, builds named by short labels with a legend of their full names."""
    from orchestrator import store
    from orchestrator.store.models import Batch

    failures, verdicts = [], []
    with sessions() as session:
        batches = [b for b in (session.get(Batch, i) for i in batch_ids) if b.summary is not None]
        for batch in batches:
            family, _ = batch_family(session, batch.id)
            for member in family:
                failures += [r for r in (member.summary or {}).get("jobs", []) if r["state"] != "succeeded"]
            verdicts.append((batch.summary["build"], final_verdicts(family)))
        names = [b.summary["build"] for b in batches]
        names += [c["baseline_build"] for _, comparisons in verdicts for c in comparisons if c.get("baseline_build")]
        shown = store.build_display_names(session, names)
    for batch in batches:
        label = shown[batch.summary["build"]]
        console.print(_device_table(batch.summary, label))
        for row in device_rows(batch.summary):
            if row["image"]:
                field(console, f"{label} image, {row['device']}", row["image"])
    for row in failures:
        console.print(f"[bold red]{escape(row['device'])}[/]: {row['kind']} job {row['job']} {row['state']}: "
                      f"{escape(row['error'] or '')}", highlight=False, soft_wrap=True)
    table = Table("build", "device", "metric", "baseline", "ratio", "95% CI", "verdict", "rounds",
                  title="analysis (against each series' last accepted build; rounds: the batch, then "
                        "its more-repetitions rounds)")
    reasons = []
    for build, comparisons in verdicts:
        for c in comparisons:
            baseline = c.get("baseline_build") or "-"
            table.add_row(shown[build], c["device"], c.get("metric", "-"), shown.get(baseline, baseline),
                          numbers.ratio(c.get("ratio")), numbers.interval(c.get("ci_low"), c.get("ci_high")),
                          c["verdict"], str(c["rounds"]))
            if c["verdict"] == "inconclusive":
                reasons.append((shown[build], c["device"], c.get("metric", "-"), c["reason"]))
    console.print(table)
    labels.legend(shown)
    for label, device, metric, reason in reasons:  # why each open verdict is open, whole
        console.print(f"inconclusive, {label} on {device}, {metric}: {reason}", highlight=False, soft_wrap=True)
    console.print("alerts: `farm regressions list`; details: `farm regressions show ID`")


def _dashboard(settings) -> None:
    from orchestrator.api.offline import export_site

    out = settings.data_dir / "dashboard"
    with console.status("writing the dashboard"):
        index = export_site(settings, out)
    console.print(f"dashboard: {index} (offline copy; live: `farm dashboard serve`)", highlight=False)


def device_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """A batch summary's jobs merged per device: the latency job's medians, the largest peak,
    the cool-down waits added up, the generated image."""
    merged: dict[str, dict[str, Any]] = {}
    for row in summary["jobs"]:
        m = merged.setdefault(row["device"], {"device": row["device"], "gpu": row["gpu"], "unet_step_ms": None,
                                              "e2e_ms": None, "peak_gpu_bytes": None, "cooldown_wait_s": 0.0,
                                              "cooldown_timed_out": False, "image": None, "states": []})
        m["states"].append(f"{row['kind']} {row['state']}")
        if row["kind"] == "latency":
            m["unet_step_ms"], m["e2e_ms"] = row["unet_step_ms"], row["e2e_ms"]
        if row["peak_gpu_bytes"] is not None:
            m["peak_gpu_bytes"] = max(m["peak_gpu_bytes"] or 0, row["peak_gpu_bytes"])
        m["cooldown_wait_s"] += row["cooldown_wait_s"] or 0.0
        m["cooldown_timed_out"] |= bool(row["cooldown_timed_out"])
        m["image"] = row["image"] or m["image"]
    return [merged[k] for k in sorted(merged)]


def _device_table(summary: dict[str, Any], label: str) -> Table:
    def ms(v):
        return f"{v:.1f}" if v is not None else "-"

    table = Table("device", "GPU", "UNet step ms", "end-to-end ms", "peak GPU MiB", "cool-down s",
                  title=f"build {label}: {summary['build']} (batch {summary['batch']})")
    for r in device_rows(summary):
        peak = f"{r['peak_gpu_bytes'] / 2**20:.1f}" if r["peak_gpu_bytes"] is not None else "-"
        cool = f"{r['cooldown_wait_s']:.1f}" + (" (timed out)" if r["cooldown_timed_out"] else "")
        gpu = (r["gpu"] or "-").split(" (")[0]  # "llvmpipe (LLVM 15.0.6, 256 bits)" -> "llvmpipe"
        table.add_row(r["device"], gpu, ms(r["unet_step_ms"]), ms(r["e2e_ms"]), peak, cool)
    return table
