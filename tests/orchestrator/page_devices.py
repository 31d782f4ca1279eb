"""Browser devices as their discovery recorded them, for tests of what the farm refuses to send them."""

from __future__ import annotations


def add_page_devices(cli, manifest, model_dir) -> None:
    """Two browser devices whose discovery recorded an Adreno 640 in Chrome: page-1 as it is,
    page-2 with a 64 KiB binding limit (no plan of the tiny model fits it); `manifest` made a
    build whose model folder, models/tiny, holds `model_dir` on this host."""
    import json
    import shutil

    from agent.protocol import DeviceInfo
    from engine.device import ADAPTERS_DIR
    from orchestrator import store
    from orchestrator.store.models import DeviceState

    adreno = json.loads((ADAPTERS_DIR / "adreno-640-chrome.json").read_text())
    adreno.pop("source")
    narrow = {**adreno, "limits": {**adreno["limits"], "max-storage-buffer-binding-size": 65536}}
    with cli.Session() as s, s.begin():
        build_name = store.create_build(s, manifest).name
        for serial, adapter in (("page-1", adreno), ("page-2", narrow)):
            info = DeviceInfo(serial=serial, model="Pixel 4", manufacturer="Google", os="android", os_version="13",
                              adapter=adapter)
            device = store.upsert_device(s, serial, "web", info=info, host="testhost", engine_host="browser")
            store.set_device_state(s, device.id, DeviceState.available)
    shutil.copytree(model_dir, cli.tmp / "data" / "builds" / build_name / "models" / "tiny")
