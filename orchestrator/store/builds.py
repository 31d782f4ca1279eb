"""Builds (a signed manifest's files, content-addressed) and deployments: created, started,
progress, finished or requeued, each a conditional update on the attempt that owns it.
A build is named by its id, its label (a short name people give it: "A", "rc1") or its full
name, all three through `resolve_build`; where no label was given, tables and charts show
the distinguishing end of its name among the builds shown (`short_names`).
Every function takes a session and flushes; the caller commits."""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from agent.protocol import Manifest

from .models import (
    Build,
    BuildFile,
    Deployment,
    DeploymentStatus,
    utcnow,
)
from .rows import StoreError, insert_or_get, made_before, redispatch_row, update_row

__all__ = [
    "build_display_names", "build_models", "builds_before", "builds_in_order", "check_label", "check_label_free", "create_build",
    "create_deployment", "default_model", "deployments_of_batch", "find_due_deployments", "finish_deployment", "free_label",
    "get_build", "get_deployment", "heartbeat_deployment", "label_build", "manifest_sha256", "pending_deployments",
    "record_deployment", "record_deployment_progress", "redispatch_deployment", "requeue_deployment",
    "resolve_build", "short_names", "start_deployment",
]

LABEL_MAX = 32
_LABEL = re.compile(r"[A-Za-z0-9._+-]+")
# Where a build name splits into the parts its distinguishing end is made of.
_SEPARATORS = re.compile(r"(?<=[-_.+])")


def manifest_sha256(manifest: Manifest) -> str:
    return hashlib.sha256(manifest.canonical_bytes()).hexdigest()


def create_build(session: Session, manifest: Manifest, label: str | None = None) -> Build:
    """Record a build and its files (with `label`, see label_build); the same manifest again
    returns the existing build."""
    digest = manifest_sha256(manifest)
    query = select(Build).where(Build.manifest_sha256 == digest)
    build = session.scalar(query)
    if build is not None:
        return build if label is None or build.label == label else label_build(session, build, label)
    if label is not None:
        check_label(label)
        check_label_free(session, label)
    clash = session.scalar(select(Build).where(Build.name == manifest.build))
    if clash is not None:
        raise StoreError(f"build {manifest.build!r} already exists with another manifest "
                         f"({clash.manifest_sha256[:12]} != {digest[:12]}): give the new build another id")
    labelled = session.scalar(select(Build).where(Build.label == manifest.build))
    if labelled is not None:
        raise StoreError(f"build name {manifest.build!r} is the label of build {labelled.id} ({labelled.name}): "
                         "give the new build another name")
    build = Build(
        name=manifest.build,
        version=manifest.version,
        source_revision=manifest.source_revision,
        manifest_sha256=digest,
        created=dt.datetime.fromtimestamp(manifest.created, dt.UTC),
        label=label,
        files=[BuildFile(path=f.path, sha256=f.sha256, size=f.size, mode=f.mode) for f in manifest.files],
    )
    return insert_or_get(session, build, query)


def check_label(label: str) -> str:
    """A build label: 1-32 letters, digits and . _ + -, not all digits (it would read as an
    id). StoreError saying what a label may be otherwise."""
    if not (1 <= len(label) <= LABEL_MAX) or not _LABEL.fullmatch(label):
        raise StoreError(f"build label {label!r} is not 1-{LABEL_MAX} letters, digits and . _ + - "
                         "(no spaces): give a short one such as A or rc1")
    if label.isdigit():
        raise StoreError(f"build label {label!r} is all digits and would read as a build id: "
                         "give one with a letter, such as B{label}")
    return label


def check_label_free(session: Session, label: str, build_id: int | None = None) -> None:
    """StoreError when a build other than `build_id` has `label` as its label or its name
    (labels and names share one namespace: a label equal to another build's name would make
    that name mean two builds)."""
    taken = session.scalar(select(Build).where(or_(Build.label == label, Build.name == label),
                                               Build.id != (build_id if build_id is not None else -1)))
    if taken is not None:
        what = "labels" if taken.label == label else "is named"
        raise StoreError(f"build label {label!r} is taken: build {taken.id} ({taken.name}) {what} {label!r}; "
                         "give another label")


def free_label(session: Session, base: str) -> str:
    """`base` when no build has it as its label or name, else the first free of base2, base3...
    (what `farm demo` labels a run's builds when an earlier run's builds are A and B)."""
    taken = set(session.scalars(select(Build.label).where(Build.label.startswith(base, autoescape=True))))
    taken |= set(session.scalars(select(Build.name).where(Build.name.startswith(base, autoescape=True))))
    return next(label for label in (base, *(f"{base}{n}" for n in range(2, len(taken) + 3))) if label not in taken)


def label_build(session: Session, build: Build, label: str | None) -> Build:
    """Give `build` the label `label` (None: take its label away). StoreError when the label is
    not one (check_label) or another build has it."""
    if label is not None:
        check_label(label)
        check_label_free(session, label, build.id)
    build.label = label
    session.flush()
    return build


def resolve_build(session: Session, ref: int | str) -> Build:
    """The build `ref` names: an id (an int, a string of digits, or `id:N`), a label or a full
    name, tried in that order. StoreError saying what was tried when none matches, and when a string
    of digits is both one build's id and another's name (names may be all digits: a CI
    pipeline's number), naming both ids, which are never ambiguous."""
    if isinstance(ref, int):
        build = session.get(Build, ref)
        if build is None:
            raise StoreError(f"no build with id {ref}; `farm builds list` shows the known ones")
        return build
    ref = ref.strip()
    if ref.startswith("id:") and ref[3:].isdigit():  # always an id (no name or label has a colon)
        return resolve_build(session, int(ref[3:]))
    tried = []
    if ref.isdigit():
        tried.append("an id")
        build = session.get(Build, int(ref))
        if build is not None:
            named = session.scalar(select(Build).where(Build.name == ref, Build.id != build.id))
            if named is not None:
                raise StoreError(f"{ref!r} is the id of build {build.name} and the name of build id {named.id}; "
                                 f"give {build.id} or {named.id} as `id:N`, or a label")
            return build
    else:
        tried.append("a label")
        build = session.scalar(select(Build).where(Build.label == ref))
        if build is not None:
            return build
    tried.append("a name")
    build = session.scalar(select(Build).where(Build.name == ref))
    if build is not None:
        return build
    raise StoreError(f"no build {ref!r} (tried as {' and '.join(tried)}); `farm builds list` shows the builds "
                     "with their ids, labels and names")


def get_build(session: Session, ref: int | str | None = None) -> Build:
    """A build by id, label or name (resolve_build); the newest one when `ref` is None.
    StoreError when unknown."""
    if ref is None:
        build = session.scalar(select(Build).order_by(Build.created.desc(), Build.id.desc()).limit(1))
        if build is None:
            raise StoreError("no builds yet; `farm builds create --model DIR` makes one")
        return build
    return resolve_build(session, ref)


def short_names(names: Sequence[str], taken: Iterable[str] = ()) -> list[str]:
    """For each of `names`, the shortest end of it (whole parts split after - _ . +) that no
    other of `names` ends with, is not all digits (an id) and is none of `taken` (labels
    shown beside them): `demo-20261129T012011Z-a` and `...-b` give `a` and `b`. Never a cut
    middle: a name with no such end, or alone, is shown whole."""
    distinct = list(dict.fromkeys(names))
    taken = set(taken)
    shown = []
    for name in names:
        parts = _SEPARATORS.split(name)
        short = name
        if len(distinct) > 1:
            for k in range(1, len(parts)):
                end = "".join(parts[-k:])
                if (not end.isdigit() and end not in taken and end.strip("-_.+")
                        and not any(other != name and other.endswith(end) for other in distinct)):
                    short = end
                    break
        shown.append(short)
    return shown


def build_display_names(session: Session, names: Sequence[str]) -> dict[str, str]:
    """What tables and charts call each of the builds `names` shown together: its label, else
    the distinguishing end of its name among them (short_names) that is no other build's label
    or name."""
    distinct = list(dict.fromkeys(n for n in names if n))
    labels: dict[str, str] = dict(session.execute(
        select(Build.name, Build.label).where(Build.name.in_(distinct), Build.label.is_not(None))).all()
    ) if distinct else {}
    # An end that is another build's label or name would name that build where it is typed.
    taken = set(labels.values())
    while True:
        derived = dict(zip(distinct, short_names(distinct, taken=taken), strict=True))
        ends = {end for name, end in derived.items() if end != name and name not in labels}
        clash = set(session.scalars(select(Build.label).where(Build.label.in_(ends)))) if ends else set()
        clash |= set(session.scalars(select(Build.name).where(Build.name.in_(ends)))) if ends else set()
        if not clash - taken:
            return {name: labels.get(name) or derived[name] for name in distinct}
        taken |= clash


def builds_in_order(session: Session) -> list[Build]:
    """Every build in the order it was made (what bisect walks)."""
    return list(session.scalars(select(Build).order_by(Build.created, Build.id)))


def builds_before(session: Session, build: Build) -> list[Build]:
    """The builds made before `build` (creation time, then id), newest first."""
    return list(session.scalars(select(Build).where(made_before(build)).order_by(Build.created.desc(), Build.id.desc())))


def deployments_of_batch(session: Session, batch_id: int) -> list[Deployment]:
    """A batch's deployments, in the order they were made."""
    return list(session.scalars(select(Deployment).where(Deployment.batch_id == batch_id).order_by(Deployment.id)))


def build_models(build: Build) -> list[str]:
    """The model folders a build ships (`models/<name>`, as job specs name them)."""
    return sorted({"/".join(f.path.split("/")[:2]) for f in build.files
                   if f.path.startswith("models/") and f.path.count("/") >= 2})


def default_model(build: Build) -> str:
    """The build's model folder when it ships exactly one; StoreError naming them otherwise."""
    models = build_models(build)
    if len(models) != 1:
        raise StoreError(f"build {build.name} ships {len(models)} models ({', '.join(models) or 'none'}): "
                         "name one with --model")
    return models[0]


def record_deployment(
    session: Session,
    build_id: int,
    device_id: int,
    status: DeploymentStatus | str,
    *,
    bytes_sent: int = 0,
    files_sent: int = 0,
    files_skipped: int = 0,
    duration_s: float | None = None,
    error: str | None = None,
    deployment_id: int | None = None,
    batch_id: int | None = None,
) -> Deployment:
    """Start a deployment (no `deployment_id`) or update one; a final status stamps finished_at."""
    status = DeploymentStatus(status)
    if deployment_id is None:
        deployment = Deployment(build_id=build_id, device_id=device_id, batch_id=batch_id)
        session.add(deployment)
    else:
        deployment = session.get(Deployment, deployment_id)
        if deployment is None:
            raise StoreError(f"no deployment {deployment_id}")
    deployment.status = status
    deployment.bytes_sent, deployment.files_sent, deployment.files_skipped = bytes_sent, files_sent, files_skipped
    deployment.duration_s, deployment.error = duration_s, error
    if status == DeploymentStatus.succeeded and deployment.bytes_total is None:
        deployment.bytes_total = bytes_sent
    if status in (DeploymentStatus.succeeded, DeploymentStatus.failed):
        deployment.finished_at = utcnow()
    session.flush()
    return deployment


def record_deployment_progress(session: Session, deployment_id: int, bytes_sent: int,
                               bytes_total: int | None) -> None:
    """A running deployment's bytes so far (one UPDATE; a finished one is left alone)."""
    session.execute(
        update(Deployment)
        .where(Deployment.id == deployment_id, Deployment.status == DeploymentStatus.running)
        .values(bytes_sent=bytes_sent, bytes_total=bytes_total)
        .execution_options(synchronize_session=False)
    )
    session.flush()


def create_deployment(session: Session, build_id: int, device_id: int, *, batch_id: int | None = None,
                      due_at: dt.datetime | None = None, allow_downgrade: bool = False) -> Deployment:
    """A pending deployment whose message must start it by `due_at` (now when None: the caller
    sends it right after its commit, or the reconciler will)."""
    deployment = Deployment(build_id=build_id, device_id=device_id, batch_id=batch_id,
                            status=DeploymentStatus.pending, due_at=due_at or utcnow(),
                            allow_downgrade=allow_downgrade)
    session.add(deployment)
    session.flush()
    return deployment


def get_deployment(session: Session, deployment_id: int) -> Deployment:
    deployment = session.get(Deployment, deployment_id)
    if deployment is None:
        raise StoreError(f"no deployment {deployment_id}")
    return deployment


def _update_deployment(session: Session, deployment_id: int, conditions: list, values: dict[str, Any]) -> bool:
    return update_row(session, Deployment, deployment_id, conditions, values)


def start_deployment(session: Session, deployment_id: int, seq: int | None) -> int | None:
    """pending -> running for the message carrying dispatch sequence `seq` (any when None);
    returns the attempt number, or None when another execution or a newer message has it."""
    conditions = [Deployment.status == DeploymentStatus.pending]
    if seq is not None:
        conditions.append(Deployment.dispatch_seq == seq)
    now = utcnow()
    if not _update_deployment(session, deployment_id, conditions,
                              {"status": DeploymentStatus.running, "attempts": Deployment.attempts + 1,
                               "heartbeat_at": now, "started_at": now, "due_at": None, "error": None}):
        return None
    return session.scalar(select(Deployment.attempts).where(Deployment.id == deployment_id))


def heartbeat_deployment(session: Session, deployment_id: int) -> None:
    _update_deployment(session, deployment_id, [Deployment.status == DeploymentStatus.running],
                       {"heartbeat_at": utcnow()})


def finish_deployment(session: Session, deployment_id: int, attempt: int, status: DeploymentStatus, *,
                      error: str | None = None, bytes_sent: int = 0, files_sent: int = 0,
                      files_skipped: int = 0, duration_s: float | None = None, note: str | None = None) -> bool:
    """running -> succeeded/failed, only for the execution of attempt `attempt` (one the
    reconciler gave up on cannot settle a newer one). False when it no longer owns it."""
    values: dict[str, Any] = {"status": status, "error": error, "bytes_sent": bytes_sent, "files_sent": files_sent,
                              "files_skipped": files_skipped, "duration_s": duration_s, "finished_at": utcnow(),
                              "note": note}
    if status == DeploymentStatus.succeeded:
        values["bytes_total"] = func.coalesce(Deployment.bytes_total, bytes_sent)
    return _update_deployment(session, deployment_id, [Deployment.status == DeploymentStatus.running,
                                                       Deployment.attempts == attempt], values)


def requeue_deployment(session: Session, deployment_id: int, attempt: int, due_at: dt.datetime, error: str) -> bool:
    """A running deployment whose worker is gone goes back to pending (due by `due_at`)."""
    return _update_deployment(session, deployment_id, [Deployment.status == DeploymentStatus.running,
                                                       Deployment.attempts == attempt],
                              {"status": DeploymentStatus.pending, "due_at": due_at, "error": error,
                               "heartbeat_at": None})


def redispatch_deployment(session: Session, deployment_id: int, due_at: dt.datetime, *,
                          new_message: bool) -> int | None:
    """Like redispatch_job, for a pending deployment."""
    return redispatch_row(session, Deployment, deployment_id, [Deployment.status == DeploymentStatus.pending], due_at,
                       new_message)


def pending_deployments(session: Session, device_ids: list[int]) -> list[Deployment]:
    """The deployments to these devices that wait to start (for a busy device or GPU), oldest first."""
    return list(session.scalars(select(Deployment).where(
        Deployment.device_id.in_(device_ids), Deployment.status == DeploymentStatus.pending).order_by(Deployment.id)))


def find_due_deployments(session: Session, now: dt.datetime, stale_before: dt.datetime) -> list[Deployment]:
    """Pending deployments past their deadline and running ones whose worker went silent."""
    last_heard = func.coalesce(Deployment.heartbeat_at, Deployment.started_at)
    return list(session.scalars(
        select(Deployment).where(or_(
            (Deployment.status == DeploymentStatus.pending) & or_(Deployment.due_at.is_(None), Deployment.due_at < now),
            (Deployment.status == DeploymentStatus.running) & (last_heard < stale_before),
        )).order_by(Deployment.id)))
