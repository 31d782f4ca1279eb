"""The embedded broker: kombu's filesystem transport with messages that appear whole.

kombu's own `_put` creates the message file in the queue folder and then writes it, so a
consumer polling at that moment can move away an empty or half-written file and fail to
decode it (the worker's consumer dies and the message is lost). Here a message is written
and flushed under a staging name in a sibling folder and renamed into the queue folder,
which on one filesystem is atomic: a consumer sees no file or the whole file. A file that
still cannot be decoded (written by something else) is set aside as `<name>.bad` in the
processed folder and logged, instead of stopping the consumer.

The URL scheme is `farmfs://`; the transport options are kombu's filesystem ones.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from queue import Empty
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

log = logging.getLogger(__name__)

SCHEME = "farmfs"
STAGING_FOLDER = ".staging"


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        out = Path(self.data_folder_out)
        staging = out.parent / STAGING_FOLDER
        staged = staging / name
        try:
            staging.mkdir(exist_ok=True)
            with open(staged, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
                f.flush()
                os.fsync(f.fileno())
            os.replace(staged, out / name)
        except OSError as exc:
            staged.unlink(missing_ok=True)
            raise ChannelError(f"cannot add message {name!r} to {out}: {exc}") from exc

    def _get(self, queue):
        """The oldest message on `queue`, moved to the processed folder first so that only one
        consumer gets it (kombu's order and claim, with undecodable files set aside)."""
        suffix = f"{queue}.msg"
        inbox, processed = Path(self.data_folder_in), Path(self.processed_folder)
        for name in sorted(os.listdir(inbox)):
            if name.partition(".")[2] != suffix:
                continue
            claimed = processed / name
            try:
                os.replace(inbox / name, claimed)
            except OSError:
                continue  # another consumer claimed it first
            try:
                payload = claimed.read_bytes()
            except OSError as exc:
                raise ChannelError(f"cannot read message {claimed}: {exc}") from exc
            try:
                message = loads(bytes_to_str(payload))
            except ValueError as exc:  # json.JSONDecodeError included
                claimed.rename(claimed.with_name(name + ".bad"))
                log.error("set aside an undecodable message on queue %s as %s.bad: %s", queue, claimed, exc)
                continue
            if not self.store_processed:
                claimed.unlink(missing_ok=True)
            return message
        raise Empty()


class Transport(filesystem.Transport):
    Channel = Channel


def register() -> None:
    """Make `farmfs://` resolve to this transport (idempotent)."""
    TRANSPORT_ALIASES.setdefault(SCHEME, f"{__name__}:Transport")


register()
