"""Tuned profiles' rows (the `profiles` table): found by id, name, content or GPU, the promoted
ones, and a new one stored. What a profile is for and when it ships is the tuning loop's
(orchestrator/analysis/profiles.py). Every function takes a session and flushes; the caller
commits."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from .models import Device, Profile

__all__ = [
    "add_profile", "find_profile", "newest_profile_for", "newest_profile_named", "profile_by_id",
    "profile_with_sha256", "profiles_for", "promoted_on_gpu", "promoted_profiles",
]


def _same_gpu(device: Device):
    """The condition on Profile for profiles tuned on `device`'s GPU (vendor, device name,
    backend); for a device whose record names no GPU (never discovered), those tuned on it."""
    if not device.gpu_device:
        return Profile.tuned_on_device_id == device.id
    return ((Profile.gpu_vendor == device.gpu_vendor) & (Profile.gpu_device == device.gpu_device)
            & (Profile.gpu_backend == device.gpu_backend))


def add_profile(session: Session, profile: Profile) -> Profile:
    """Store a new profile (it has its id on return)."""
    session.add(profile)
    session.flush()
    return profile


def profile_by_id(session: Session, profile_id: int) -> Profile | None:
    return session.get(Profile, profile_id)


def newest_profile_named(session: Session, name: str) -> Profile | None:
    """The newest profile called `name`, or None."""
    return session.scalar(select(Profile).where(Profile.name == name).order_by(Profile.id.desc()).limit(1))


def find_profile(session: Session, name: str, sha256: str) -> Profile | None:
    """The profile called `name` with this content (the sha256 of its document), or None."""
    return session.scalar(select(Profile).where(Profile.name == name, Profile.sha256 == sha256))


def profile_with_sha256(session: Session, sha256: str) -> Profile | None:
    """A profile with this content, whatever its name, or None."""
    return session.scalar(select(Profile).where(Profile.sha256 == sha256).limit(1))


def profiles_for(session: Session, device: Device | None = None) -> list[Profile]:
    """The tuned profiles, newest first; those made on `device`'s GPU when given (any device of
    the same GPU)."""
    query = select(Profile).order_by(Profile.id.desc())
    return list(session.scalars(query if device is None else query.where(_same_gpu(device))))


def newest_profile_for(session: Session, device: Device) -> Profile | None:
    """The newest profile tuned on `device`'s GPU (any device of the same GPU), or None."""
    return session.scalar(select(Profile).where(_same_gpu(device)).order_by(Profile.id.desc()).limit(1))


def promoted_profiles(session: Session) -> list[Profile]:
    """Every promoted profile, in the order they were promoted."""
    return list(session.scalars(select(Profile).where(Profile.promoted_at.is_not(None)).order_by(Profile.promoted_at)))


def promoted_on_gpu(session: Session, profile: Profile) -> list[Profile]:
    """The other profiles promoted for `profile`'s GPU (vendor, device name, backend)."""
    return list(session.scalars(select(Profile).where(
        Profile.gpu_vendor == profile.gpu_vendor, Profile.gpu_device == profile.gpu_device,
        Profile.gpu_backend == profile.gpu_backend, Profile.promoted_at.is_not(None), Profile.id != profile.id)))
