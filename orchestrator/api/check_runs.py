"""Checks started through the API: each runs `orchestrator.services.check.run_check` (which blocks while
its batches run) in a thread of the API process, with its state kept in the store (CheckRun):
running (its progress the watch's last line: jobs done, and a host no worker serves), then done
with the report's exit code and outcome, bad_input (3) or failed (4) with the error and, when it
had started, the report so far (outcome could_not_run; the service cancelled its jobs: a check
with no worker ends after its request's no_worker_s, not at its timeout). The input is checked before the thread starts (check.builds_compared), so a request naming an
unknown build or device, or a farm with no device to run on, is refused at once. A check that
was running when the API process stopped cannot go on (its thread is gone, its batches may
still finish): `CheckRunner` marks it interrupted when the next API process starts."""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

from celery import Celery

from orchestrator import store
from orchestrator.services import check as gate
from orchestrator.store.models import CheckRun, CheckState, utcnow

log = logging.getLogger(__name__)

PROGRESS_CHARS = 500


class CheckRunner:
    """Starts checks in daemon threads and records what becomes of them."""

    def __init__(self, sessions: store.SessionFactory, app: Celery):
        self.sessions, self.app = sessions, app
        self.threads: dict[int, threading.Thread] = {}

    def interrupt_leftovers(self) -> list[int]:
        """Mark every check still `running` in the store as interrupted: none of them has a
        thread any more (called once, when the API starts)."""
        with self.sessions() as session, session.begin():
            ids = store.interrupt_running_checks(
                session, exit_code=gate.FAILED, error="the API process stopped while the check ran; start it again")
        if ids:
            log.warning("checks %s were running when the API stopped: marked interrupted", ids)
        return ids

    def start(self, session: store.Session, request: gate.CheckRequest, token_id: int | None) -> CheckRun:
        """Check the request (CheckInput names what is wrong), record the check and start its
        thread. Commits `session`."""
        gate.builds_compared(session, request)
        row = store.add_check_run(session, _as_dict(request), token_id)
        session.commit()
        thread = threading.Thread(target=self._run, args=(row.id, request), name=f"check-{row.id}", daemon=True)
        self.threads[row.id] = thread
        thread.start()
        return row

    def _run(self, check_id: int, request: gate.CheckRequest) -> None:
        def progress(line: str) -> None:
            self._update(check_id, progress=line[:PROGRESS_CHARS])

        try:
            report = gate.run_check(self.app, self.sessions, request, progress)
        except gate.CheckInput as exc:
            self._finish(check_id, CheckState.bad_input, gate.BAD_INPUT, "bad_input", error=str(exc))
        except gate.CheckFailed as exc:  # its jobs cancelled by the service; the report says what it did
            self._finish(check_id, CheckState.failed, gate.FAILED, "failed", error=str(exc), report=exc.report)
        except Exception as exc:  # noqa: BLE001  (whatever ends the thread is the check's outcome)
            log.exception("check %s", check_id)
            self._finish(check_id, CheckState.failed, gate.FAILED, "failed",
                         error=f"{exc.__class__.__name__}: {exc}")
        else:
            self._finish(check_id, CheckState.done, report["exit_code"], report["outcome"], report=report)
        finally:
            self.threads.pop(check_id, None)

    def _update(self, check_id: int, **values: Any) -> None:
        with self.sessions() as session, session.begin():
            store.update_check_run(session, check_id, **values)

    def _finish(self, check_id: int, state: CheckState, exit_code: int, outcome: str, *,
                error: str | None = None, report: dict[str, Any] | None = None) -> None:
        self._update(check_id, state=state, exit_code=exit_code, outcome=outcome,
                     error=None if error is None else store.text_for_store(error), report=_finite(report),
                     finished_at=utcnow())


def _as_dict(request: gate.CheckRequest) -> dict[str, Any]:
    return {"candidate": request.candidate, "baseline": request.baseline, "devices": request.devices,
            "metrics": list(request.metrics), "spec": request.spec, "pairs": request.pairs,
            "max_rounds": request.max_rounds, "images": request.images, "timeout_s": request.timeout_s,
            "no_worker_s": request.no_worker_s}


def _finite(value: Any) -> Any:
    """`value` with every infinite or NaN number as None: JSON has none (PostgreSQL refuses
    `Infinity`), and a report has one where two images are equal (PSNR inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
