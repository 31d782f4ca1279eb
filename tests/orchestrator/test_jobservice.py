"""The job service's targeting: the one rule `farm jobs submit` and the suites (schedules,
more-repetitions rounds, `farm regressions bisect`, the demo) share for which devices run a
submission, and where they part on a quarantined device."""

from __future__ import annotations

import pytest

from orchestrator import store
from orchestrator.jobs.jobservice import target_devices
from orchestrator.store.models import DeviceState


def test_targets_all_in_service_devices_or_the_named_ones_once(Session):  # noqa: N803
    with Session() as session, session.begin():
        for serial in ("phone-1", "phone-2", "phone-3"):
            store.upsert_device(session, serial, "adb", f"127.0.0.1:{5990 + int(serial[-1])}", host="h")
        store.set_device_state(session, store.get_device(session, "phone-3").id, DeviceState.quarantined,
                               "battery swollen", force=True)

        def serials(devices, refuse: bool) -> list[str]:
            return [d.serial for d in target_devices(session, devices, refuse_quarantined=refuse)]

        assert serials("all", refuse=True) == ["phone-1", "phone-2"]  # never the quarantined one
        assert serials(["phone-2", "phone-1", "phone-2"], refuse=True) == ["phone-2", "phone-1"]
        # A suite keeps a named quarantined device (its jobs end infra_failed, with why, when
        # they come to run); a submission refuses it at once.
        assert serials(["phone-3", "phone-1"], refuse=False) == ["phone-3", "phone-1"]
        with pytest.raises(store.StoreError, match=r"'phone-3' is quarantined \(battery swollen\); "
                                                   r"`farm devices release phone-3` first"):
            serials(["phone-1", "phone-3"], refuse=True)
        with pytest.raises(store.StoreError):
            serials(["phone-9"], refuse=False)
        with pytest.raises(store.StoreError, match="no devices to run on"):
            serials([], refuse=False)
