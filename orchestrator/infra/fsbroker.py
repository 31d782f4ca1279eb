"""The embedded broker: kombu's filesystem transport with messages that appear whole and stay
until they are acknowledged.

Appearing whole: kombu's own `_put` creates the message file in the queue folder and then
writes it, so a consumer polling at that moment can move away an empty or half-written file
and fail to decode it. Here a message is written and flushed under a staging name in a sibling
folder and renamed into the queue folder, which on one filesystem is atomic: a consumer sees no
file or the whole file. A file that still cannot be decoded (written by something else) is set
aside as `<name>.bad` in the processed folder and logged, instead of stopping the consumer.

Acknowledgement: kombu's transport deletes a message when a consumer takes it, and "unacked"
lives only in that consumer's memory, so a worker SIGKILLed while holding a message (a task
running with acks_late, an ETA retry waiting for its time, a prefetched one) loses it. Here a
taken message is claimed by renaming it into the processed folder under its name plus its
owner (`<name>~<host>.<pid>.<process start time>`): invisible to other consumers, deleted only
when acknowledged, and put back under its own name (so in its original order) when rejected
with requeue or when the channel closes. Any consumer checks the claims every
RESTORE_EVERY_S and puts back those whose owner process is gone, so a message held by a dead
worker comes back within that time of the next consumer polling.

Exchange tables: kombu creates an exchange's table file and then locks and writes it, so a
process binding or publishing at that moment reads an empty file and fails to decode it, and
two processes creating it at once can overwrite each other's binding. Here a table is changed
under an exclusive lock on a sibling lock file and replaced whole by a rename; readers need no
lock, and an empty table file (left by kombu's own code) reads as no bindings.

The URL scheme is `farmfs://`; the transport options are kombu's filesystem ones.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from contextlib import contextmanager
from pathlib import Path
from queue import Empty
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem, virtual
from kombu.transport.filesystem import LOCK_EX, exchange_queue_t, lock, unlock
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

log = logging.getLogger(__name__)

SCHEME = "farmfs"
STAGING_FOLDER = ".staging"
CLAIM_SEPARATOR = "~"
RESTORE_EVERY_S = 1.0


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, which with the pid names one process
    for good (a pid reused later has another start time); None when it does not run. Without
    procfs only the pid is checked ("?")."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"
    # Field 22; the command name (field 2) may hold spaces and parentheses, so count from its end.
    return stat[stat.rindex(")") + 2:].split()[19]


def _host() -> str:
    return "".join(c if c.isalnum() or c == "-" else "-" for c in socket.gethostname()) or "host"


def owner_id(pid: int | None = None) -> str:
    """This process's claim name: host, pid and start time."""
    pid = os.getpid() if pid is None else pid
    return f"{_host()}.{pid}.{_start_time(pid) or '?'}"


def owner_alive(owner: str) -> bool:
    """Whether the process that made a claim still runs; a claim made on another host counts as
    alive (its owner cannot be checked from here)."""
    host, _, rest = owner.partition(".")
    pid_text, _, start = rest.partition(".")
    if host != _host() or not pid_text.isdigit():
        return True
    now = _start_time(int(pid_text))
    return now is not None and (now == start or "?" in (now, start))


class QoS(virtual.QoS):
    """Acknowledging deletes the claim file; rejecting with requeue and closing the channel put
    it back in the queue under its own name."""

    def ack(self, delivery_tag):
        self.channel._settle_claim(delivery_tag, requeue=False)
        super().ack(delivery_tag)

    def reject(self, delivery_tag, requeue=False):
        self.channel._settle_claim(delivery_tag, requeue=requeue)
        self._quick_ack(delivery_tag)

    def restore_unacked(self):
        self._flush()
        for delivery_tag in list(self._delivered):
            self.channel._settle_claim(delivery_tag, requeue=True)
        self._delivered.clear()
        return []


class Channel(filesystem.Channel):
    QoS = QoS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._claims: dict[str, Path] = {}  # delivery tag -> claim file
        self._no_ack_queues: set[str] = set()
        self._owner = owner_id()
        self._next_restore = 0.0

    def basic_consume(self, queue, no_ack, *args, **kwargs):
        if no_ack:  # nothing will acknowledge these (remote control replies): no claim is kept
            self._no_ack_queues.add(queue)
        return super().basic_consume(queue, no_ack, *args, **kwargs)

    def basic_get(self, queue, no_ack=False, **kwargs):
        if no_ack:
            self._no_ack_queues.add(queue)
        return super().basic_get(queue, no_ack, **kwargs)

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
        """The oldest message on `queue`, claimed first (renamed into the processed folder with
        this process as its owner) so that only one consumer gets it."""
        if monotonic() >= self._next_restore:
            self._next_restore = monotonic() + RESTORE_EVERY_S
            self.restore_orphans()
        suffix = f"{queue}.msg"
        inbox, processed = Path(self.data_folder_in), Path(self.processed_folder)
        for name in sorted(os.listdir(inbox)):
            if name.partition(".")[2] != suffix:
                continue
            claimed = processed / f"{name}{CLAIM_SEPARATOR}{self._owner}"
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
                delivery_tag = message["properties"]["delivery_tag"]
            except (ValueError, KeyError, TypeError) as exc:  # json.JSONDecodeError included
                claimed.rename(processed / f"{name}.bad")
                log.error("set aside an undecodable message on queue %s as %s.bad: %s", queue, name, exc)
                continue
            if queue in self._no_ack_queues:
                claimed.unlink(missing_ok=True)
            else:
                self._claims[delivery_tag] = claimed
            return message
        raise Empty()

    # ---- exchange tables -------------------------------------------------------------------

    def get_table(self, exchange):
        return _read_table(self._exchange_file(exchange))

    def _queue_bind(self, exchange, routing_key, pattern, queue):
        binding = exchange_queue_t(routing_key or "", pattern or "", queue or "")
        with self._table_for_change(exchange) as queues:
            if binding not in queues:
                queues.insert(0, binding)

    def _delete(self, queue, exchange, routing_key, pattern, *args, **kwargs):
        virtual.Channel._delete(self, queue, exchange, routing_key, pattern, *args, **kwargs)
        binding = exchange_queue_t(routing_key or "", pattern or "", queue or "")
        with self._table_for_change(exchange) as queues:
            if binding in queues:
                queues.remove(binding)

    @contextmanager
    def _table_for_change(self, exchange):
        """The exchange's bindings as a list to change in place, read and written back (whole,
        by rename) under the exchange's lock file."""
        file = self._exchange_file(exchange)
        try:
            self.control_folder.mkdir(exist_ok=True)
            guard = open(file.with_name(file.name + ".lock"), "ab")
        except OSError as exc:
            raise ChannelError(f"cannot open the lock of {file}: {exc}") from exc
        try:
            lock(guard, LOCK_EX)
            queues = _read_table(file)
            before = list(queues)
            yield queues
            if queues != before:
                staged = file.with_name(f".{file.name}.{os.getpid()}.tmp")
                try:
                    staged.write_bytes(str_to_bytes(dumps(queues)))
                    os.replace(staged, file)
                except OSError as exc:
                    staged.unlink(missing_ok=True)
                    raise ChannelError(f"cannot write {file}: {exc}") from exc
        finally:
            unlock(guard)
            guard.close()

    def _settle_claim(self, delivery_tag, *, requeue: bool) -> None:
        claimed = self._claims.pop(delivery_tag, None)
        if claimed is None:
            return
        try:
            if requeue:
                os.replace(claimed, Path(self.data_folder_in) / claimed.name.rpartition(CLAIM_SEPARATOR)[0])
            else:
                claimed.unlink(missing_ok=True)
        except OSError as exc:
            log.error("cannot %s message %s: %s", "requeue" if requeue else "remove", claimed.name, exc)

    def restore_orphans(self) -> list[str]:
        """Put back every claimed message whose owner process is gone; returns their names."""
        processed, inbox = Path(self.processed_folder), Path(self.data_folder_in)
        restored = []
        try:
            names = os.listdir(processed)
        except OSError:
            return restored
        for claim in names:
            name, sep, owner = claim.rpartition(CLAIM_SEPARATOR)
            if not sep or owner == self._owner or owner_alive(owner):
                continue
            try:
                os.replace(processed / claim, inbox / name)
            except OSError:
                continue  # another consumer restored it first
            restored.append(name)
        if restored:
            log.warning("put back %d message(s) claimed by consumers that are gone: %s", len(restored),
                        ", ".join(restored[:5]))
        return restored


def _read_table(file: Path) -> list:
    """An exchange table's bindings; none when the file is missing or still empty."""
    try:
        text = bytes_to_str(file.read_bytes())
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ChannelError(f"cannot read {file}: {exc}") from exc
    if not text.strip():
        return []
    try:
        return [exchange_queue_t(*q) for q in loads(text)]
    except (ValueError, TypeError) as exc:
        raise ChannelError(f"{file} is not an exchange table: {exc}") from exc


class Transport(filesystem.Transport):
    Channel = Channel

    def drain_events(self, connection, timeout=None):
        """Wait for a message; while a consumer's prefetch slots are all held, for one polling
        interval only.

        celery's worker loop for transports without an event loop (synloop) acknowledges
        finished tasks, which frees their prefetch slots, only between calls, and calls with a
        2 s timeout. A call made with every slot held by a task that had already finished waited
        out those 2 s: a worker took `prefetch` messages every 2 s however short its tasks were
        (1 task/s for one worker of concurrency 2). Now that call returns after one polling
        interval and the loop settles the slots."""
        if timeout is not None and self.polling_interval and self._prefetch_full():
            timeout = min(timeout, self.polling_interval)
        return super().drain_events(connection, timeout=timeout)

    def _prefetch_full(self) -> bool:
        """Some consuming channel has a prefetch limit and every slot of it held (a worker's
        task channel; its remote-control channel has no limit and is left out)."""
        return any(channel._consumers and channel.qos.prefetch_count and not channel.qos.can_consume()
                   for channel in self.channels)


def register() -> None:
    """Make `farmfs://` resolve to this transport (idempotent)."""
    TRANSPORT_ALIASES.setdefault(SCHEME, f"{__name__}:Transport")


register()
