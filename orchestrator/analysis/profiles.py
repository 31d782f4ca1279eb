"""The tuning loop: a tune job's profile is registered (the `profiles` table), a latency job
asking for profile "tuned" is sent the newest profile tuned on its device's GPU, a batch
that timed that profile and the GPU family's on one device measures the gain, and a promoted
profile ships in the builds made after it (profiles/tuned/ in the bundle, where the agent's
"auto" prefers the one made on the device's exact GPU over the family's).

What a profile is called, and never more: "estimated" (from its tune's kernel times, which
leave out everything between kernels) until a latency run of it and of the family's profile
on its GPU measured the gain."""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from agent.protocol import JobResult
from orchestrator import store
from orchestrator.store import Session, queries
from orchestrator.store.models import Job, JobKind, JobState, Profile, Run

log = logging.getLogger(__name__)

TUNED = "tuned"  # the profile a latency job asks for to time the newest profile tuned on its GPU
FAMILY = "family"  # the GPU family's profile (what the device runs without a tuned one)
GAIN_METRIC = "unet_step_ms"
GAIN_CONFIDENCE = 0.95


class ProfileError(store.StoreError):
    """No such profile, or one that cannot be used as asked."""


def profile_sha256(doc: dict) -> str:
    from engine.profiles import profile_sha256 as sha

    return sha(doc)


def register(session: Session, job: Job, run: Run, result: JobResult, artifacts_dir: Path | None) -> Profile | None:
    """Store the profile a succeeded tune run brought back (flushes only); the same document
    registered before (same name and content) is returned as it is. None when the run has no
    profile artifact to read."""
    artifact = next((a for a in result.artifacts if a.kind == "profile"), None)
    if job.kind != JobKind.tune or result.status != "succeeded" or artifact is None or artifacts_dir is None:
        return None
    path = artifacts_dir / artifact.path
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("job %s: cannot read its tuned profile %s (%s); not registered", job.id, path, exc)
        return None
    device, sha = job.device, profile_sha256(doc)
    adapter = (result.engine or {}).get("adapter") or {}  # what it ran on (the device record may lag)
    existing = store.find_profile(session, doc.get("name", ""), sha)
    if existing is not None:
        return existing
    build = store.get_build(session, job.build_id) if job.build_id is not None else None
    environment = run.environment or {}
    estimate = (result.engine or {}).get("estimated_gain") or {}
    profile = Profile(
        name=str(doc.get("name", f"tuned-job{job.id}")), sha256=sha, data=doc,
        gpu_vendor=str(adapter.get("vendor", device.gpu_vendor)),
        gpu_architecture=str(adapter.get("architecture", device.gpu_architecture)),
        gpu_device=str(adapter.get("device", device.gpu_device)),
        gpu_backend=str(adapter.get("backend", device.gpu_backend)),
        gpu_driver=str(environment.get("driver") or device.gpu_driver or ""),
        engine_version=f"{build.name} ({build.version})" if build is not None else "",
        tuned_on_device_id=device.id, tune_run_id=run.id,
        family=str((result.engine or {}).get("family_profile") or ""),
        estimated_gain=estimate.get("gain"),
    )
    return store.add_profile(session, profile)


def get(session: Session, ref: int | str) -> Profile:
    """A profile by id, or by name (the newest of that name)."""
    if isinstance(ref, int) or str(ref).isdigit():
        profile = store.profile_by_id(session, int(ref))
    else:
        profile = store.newest_profile_named(session, ref)
    if profile is None:
        raise ProfileError(f"no profile {ref!r}; `farm profiles list` shows them")
    return profile


def resolve_tuned(session: Session, job: Job) -> str | None:
    """A latency job asking for "tuned" gets the document of the newest profile tuned on its
    GPU, stored in its spec (so the job's record says what it ran). Returns an error when
    there is none (flushes only)."""
    spec = dict(job.spec or {})
    if spec.get("profile") != TUNED or spec.get("profile_document"):
        return None
    profile = store.newest_profile_for(session, job.device)
    if profile is None:
        return (f"no profile has been tuned on {job.device.gpu_device or 'this GPU'} yet: run a tune job on "
                f"{job.device.serial} (or a device with the same GPU) first")
    job.spec = spec | {"profile_document": profile.data}
    return None


def promoted(session: Session) -> list[Profile]:
    """The profiles builds ship: the newest promoted one per GPU."""
    shipped: dict[tuple[str, str, str], Profile] = {}
    for p in store.promoted_profiles(session):
        shipped[(p.gpu_vendor, p.gpu_device, p.gpu_backend)] = p
    return sorted(shipped.values(), key=lambda p: p.name)


def promote(session: Session, profile: Profile, now: dt.datetime | None = None) -> list[Profile]:
    """Ship `profile` in the builds made from now on, in place of the one promoted for its GPU
    before (returned, now demoted). Flushes only."""
    replaced = store.promoted_on_gpu(session, profile)
    for other in replaced:
        other.promoted_at = None
    profile.promoted_at = now or store.utcnow()
    session.flush()
    return replaced


def write_promoted(session: Session, folder: Path) -> list[str]:
    """The promoted profiles as files in `folder` (a build's profiles/tuned/); their names."""
    names = []
    for profile in promoted(session):
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{profile.name}.json"
        (folder / name).write_text(json.dumps(profile.data, indent=1) + "\n")
        names.append(name)
    return names


def measure_gains(session: Session, batch_id: int) -> list[dict[str, Any]]:
    """For each device of the batch that timed both the newest tuned profile ("tuned") and its
    family's ("family") with one build: the gain (family UNet step median / tuned), its 95%
    bootstrap interval, and a verdict; recorded on the profile (flushes only)."""
    from orchestrator.analysis.stats.compare import bootstrap_ratio_ci

    jobs = [job for job in store.jobs_of_batches(session, [batch_id])
            if job.kind == JobKind.latency and job.state == JobState.succeeded]
    by_device: dict[tuple[int, int | None], dict[str, Job]] = {}
    for job in jobs:
        profile = (job.spec or {}).get("profile")
        if profile in (TUNED, FAMILY):
            by_device.setdefault((job.device_id, job.build_id), {})[profile] = job
    found = []
    for (device_id, _build_id), pair in sorted(by_device.items(), key=lambda kv: kv[0][0]):
        if set(pair) != {TUNED, FAMILY}:
            continue
        device = store.get_device(session, device_id)
        doc = pair[TUNED].spec.get("profile_document") or {}
        profile = store.profile_with_sha256(session, profile_sha256(doc)) if doc else None
        tuned, family = (_values(session, pair[k]) for k in (TUNED, FAMILY))
        if profile is None or tuned.size == 0 or family.size == 0:
            continue
        gain = float(np.median(family) / np.median(tuned))
        low, high, _ = bootstrap_ratio_ci(tuned, family, confidence=GAIN_CONFIDENCE, n_boot=2000, seed=0)
        verdict = "faster" if low > 1 else "slower" if high < 1 else "no clear difference"
        profile.measured_gain, profile.measured_gain_ci = gain, [float(low), float(high)]
        profile.measured_in_batch_id = batch_id
        found.append({"device": device.serial, "profile": profile.name, "profile_id": profile.id,
                      "family": profile.family, "metric": GAIN_METRIC, "gain": gain, "ci_low": float(low),
                      "ci_high": float(high), "n_tuned": int(tuned.size), "n_family": int(family.size),
                      "estimated_gain": profile.estimated_gain, "verdict": verdict})
    session.flush()
    return found


def _values(session: Session, job: Job) -> np.ndarray:
    run = queries.newest_run(session, job.id, succeeded=True)
    if run is None:
        return np.array([])
    return np.array([value for _, value in queries.run_samples(session, run.id, [GAIN_METRIC])], dtype=float)
