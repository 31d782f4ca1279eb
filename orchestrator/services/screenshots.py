"""A look at a device's screen (`farm devices screenshot`): its transport takes the PNG (adb:
`screencap -p`; a browser device: its page through Chromium's DevTools protocol;
orchestrator/transports), the farm keeps it under <data_dir>/screenshots/<serial>/ and records it
in the store, where the API and the dashboard find the newest. No transaction is held while the
device is asked. A device keeps its newest KEPT; the screenshots of a device removed from the
farm go with its rows (`farm devices remove`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from agent.files import atomic_write
from orchestrator import store
from orchestrator.infra.settings import Settings
from orchestrator.transports.base import Screenshot

SCREENSHOTS = "screenshots"  # under the data dir
KEPT = 20  # screenshots kept per device: taking one more forgets the oldest, its file too


@dataclass
class Taken:
    """A screenshot kept: where (`path`, absolute; the store holds it relative to the data dir),
    its size and source, and the store's row id."""

    id: int
    serial: str
    path: Path
    sha256: str
    size: int
    width: int
    height: int
    source: str
    taken_at: str


def forget_device_screenshots(settings: Settings, serial: str) -> None:
    """Delete a removed device's screenshot files (its rows went with it)."""
    import shutil

    folder = settings.data_dir / SCREENSHOTS / serial
    if folder.is_dir() and folder.parent == settings.data_dir / SCREENSHOTS:  # (a serial is one plain name)
        shutil.rmtree(folder, ignore_errors=True)


def screenshot_file(settings: Settings, stored_path: str) -> Path:
    """Where a stored screenshot's PNG lies: its path is relative to the data dir."""
    return settings.data_dir / stored_path


def take_screenshot(settings: Settings, sessions, serial: str) -> Taken:
    """The device's screen now, kept and recorded. StoreError for an unknown device or one whose
    address cannot be used; TransportError (one line, naming the device) when it cannot be
    captured."""
    from orchestrator.transports.factory import make_transport

    with sessions() as session:
        device = store.get_device(session, serial)
        device_id = device.id
        try:
            transport = make_transport(device, settings)
        except ValueError as exc:
            raise store.StoreError(f"{serial}: its stored address cannot be used: {exc}") from None
    with transport:
        shot: Screenshot = transport.screenshot()
    taken_at = store.utcnow()
    sha256 = hashlib.sha256(shot.png).hexdigest()
    relative = Path(SCREENSHOTS) / serial / f"{taken_at:%Y%m%dT%H%M%S%fZ}-{sha256[:8]}.png"
    path = settings.data_dir / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, shot.png)
    with sessions() as session, session.begin():
        row = store.record_screenshot(session, device_id, relative.as_posix(), sha256, len(shot.png), shot.width,
                                      shot.height, shot.source, taken_at)
        row_id = row.id
        forgotten = store.prune_screenshots(session, device_id, KEPT)
    for old in forgotten:  # after the commit: a file whose row is gone is never served
        (settings.data_dir / old).unlink(missing_ok=True)
    return Taken(row_id, serial, path, sha256, len(shot.png), shot.width, shot.height, shot.source,
                 taken_at.isoformat())

