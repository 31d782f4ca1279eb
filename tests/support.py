"""What many tests share: a free port on 127.0.0.1 and waiting for a condition. (Faults on a
connection are net_support.py's; the fault tests' workers are orchestrator/worker_farm.py's.)"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the caller binds it soon after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout_s: float = 5.0, every_s: float = 0.05) -> bool:
    """Poll `predicate` until it is truthy (True) or `timeout_s` has passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True
