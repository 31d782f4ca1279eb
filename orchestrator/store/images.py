"""The images generate jobs made, as the analysis' fidelity check and the dashboard's galleries
find them: by id or file, a job's newest, a series' on one device and build, a build's all.
Reads only (a run's images are recorded with it: results.record_result)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Row, select
from sqlalchemy.orm import Session

from .models import Device, Image, Job, JobKind, Run, RunStatus
from .rows import StoreError, in_series

__all__ = ["generated_images", "get_image", "image_at", "images_of_build", "newest_image_of_job"]


def get_image(session: Session, image_id: int) -> Image:
    image = session.get(Image, image_id)
    if image is None:
        raise StoreError(f"no image {image_id}")
    return image


def image_at(session: Session, path: str) -> Image | None:
    """The newest image stored at `path`, or None."""
    return session.scalar(select(Image).where(Image.path == path).order_by(Image.id.desc()).limit(1))


def newest_image_of_job(session: Session, job_id: int) -> Image | None:
    """An image of the job's newest succeeded attempt, or None."""
    return session.scalar(select(Image).join(Run, Run.id == Image.run_id).where(
        Run.job_id == job_id, Run.status == RunStatus.succeeded).order_by(Run.attempt.desc()).limit(1))


def generated_images(session: Session, device_id: int, build_id: int) -> list[tuple[Image, dict[str, Any] | None]]:
    """The images a build's series generate runs (no check's) made on a device, newest first,
    each with its job's spec."""
    return [tuple(r) for r in session.execute(
        select(Image, Job.spec).join(Run, Run.id == Image.run_id).join(Job, Job.id == Run.job_id)
        .where(Run.device_id == device_id, Run.build_id == build_id, Job.kind == JobKind.generate,
               Run.status == RunStatus.succeeded, in_series())
        .order_by(Image.id.desc()))]


def images_of_build(session: Session, build_id: int) -> list[Row]:
    """Every image a succeeded run of a build made (a check's included), newest first:
    (Image, job spec, job id, device serial)."""
    return list(session.execute(
        select(Image, Job.spec, Job.id, Device.serial).join(Run, Run.id == Image.run_id)
        .join(Job, Job.id == Run.job_id).join(Device, Device.id == Run.device_id)
        .where(Run.build_id == build_id, Run.status == RunStatus.succeeded)
        .order_by(Image.id.desc())))
