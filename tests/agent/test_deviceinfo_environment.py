"""Every run carries its environment: a real job on this machine's adapter records the OS,
kernel, driver, adapter, wgpu-native's version and the profile it ran (named and hashed); an
Android device's environment comes from its properties (a getprop file for the virtual phone,
and the virtual phone hands its agent one); a result without an environment, from an older
agent, still parses."""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

import pytest
from adb_shell.adb_device import AdbDevice
from adb_shell.transport.tcp_transport import TcpTransport

from agent import deviceinfo
from agent.jobs import run_job
from agent.protocol import (
    JobResult,
    JobSpec,
    ProtocolError,
    RunEnvironment,
    from_dict,
    from_json,
    to_dict,
)
from agent.simulator import VirtualPhone
from agent.simulator.shell import AgentSettings

DATA = Path(__file__).parent / "data"


@pytest.mark.gpu
def test_a_latency_run_records_the_environment_it_ran_in(tiny_model_dir, tmp_path, gpu):
    spec = JobSpec(job_id="env1", kind="latency", model=str(tiny_model_dir), precision="fp32", steps=1, warmup=0,
                   unet_repetitions=1, repetitions=1, kernel_timings=False, profile="auto")
    result = run_job(spec, tmp_path / "out", tmp_path / "root")
    assert result.status == "succeeded", (result.error or "") + result.log_tail
    env = result.environment
    assert env is not None and env.source == "agent"
    assert (env.os, env.kernel) == (platform.system().lower(), platform.release())
    assert env.os_version == platform.release()  # Linux: the kernel's release, as DeviceInfo says
    caps = gpu.caps
    assert env.driver == caps.description
    assert {k: env.adapter[k] for k in ("vendor", "device", "backend", "vendor_id", "device_id")} == {
        "vendor": caps.vendor, "device": caps.device, "backend": caps.backend, "vendor_id": caps.vendor_id,
        "device_id": caps.device_id}
    assert env.adapter["adapter_id"] == deviceinfo.adapter_id(caps.as_dict())
    import wgpu.backends.wgpu_native as native

    assert env.runtime["kind"] == "wgpu-native"
    assert env.runtime["version"] == ".".join(map(str, native.lib_version_info))
    assert env.runtime["shader_checks"] == "off"  # the engine's kernels compiled unchecked (FARM_SHADER_CHECKS unset)
    # The profile the engine ran: the shipped one the auto rule picked, by name and content
    # (the hash the farm registers tuned profiles under).
    from engine.profiles import auto_profile

    profile = auto_profile(caps)
    doc = json.loads(Path(profile.source).read_text()) if Path(profile.source).is_file() else profile.to_json()
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert env.profile == {"name": result.engine["profile"], "sha256": hashlib.sha256(canonical).hexdigest()}
    assert env.profile["name"] == profile.name
    # Clocks are what the device gives: never invented, the same readings the agent itself takes.
    assert set(env.clocks_mhz) <= set(deviceinfo.read_thermal_local(with_clocks=True)[1])
    stored = from_json(JobResult, (tmp_path / "out" / "result.json").read_text())
    assert stored.environment == env


def test_android_environment_comes_from_the_properties(tmp_path, monkeypatch):
    props = deviceinfo.parse_getprop((DATA / "s23ultra.getprop.txt").read_text())
    monkeypatch.setenv(deviceinfo.GETPROP_FILE_ENV, str(DATA / "s23ultra.getprop.txt"))
    adapter = {"vendor": "qualcomm", "architecture": "adreno-7xx", "device": "Adreno (TM) 740",
               "description": "Qualcomm Technologies Inc. Adreno Vulkan Driver 0762.10", "backend": "Vulkan",
               "features": ["shader-f16"], "limits": {"max-buffer-size": 1 << 30}}
    env = deviceinfo.read_environment(adapter, clocks_mhz={"gpu": 680.0})
    assert (env.os, env.os_version) == ("android", props["ro.build.version.release"])
    assert env.os_build == props["ro.build.fingerprint"] and env.os_build
    assert env.driver == "Qualcomm Technologies Inc. Adreno Vulkan Driver 0762.10"
    assert "features" not in env.adapter and "limits" not in env.adapter  # identity only
    assert env.adapter["device"] == "Adreno (TM) 740" and env.clocks_mhz == {"gpu": 680.0}
    # Elsewhere (no getprop file, no /system/bin/getprop) it is the host's own OS.
    monkeypatch.delenv(deviceinfo.GETPROP_FILE_ENV)
    monkeypatch.setattr(deviceinfo, "ANDROID_GETPROP", str(tmp_path / "no-getprop"))
    assert deviceinfo.android_properties() == {}
    host = deviceinfo.read_environment(adapter, clocks_mhz={})
    assert (host.os, host.kernel) == (platform.system().lower(), platform.release())


def test_the_virtual_phones_agent_records_the_phones_os(tmp_path):
    """The virtual phone's agent runs on the host; its runs still record the phone's Android
    release and build fingerprint (not the host's OS), with the host's kernel, which is the
    phone's too."""
    code = ("import json; from agent.deviceinfo import read_environment; from agent.protocol import to_dict\n"
            "print(json.dumps(to_dict(read_environment({'device': 'x', 'description': 'd'}, {}))))")
    agent = AgentSettings(command=(sys.executable, "-c", code))
    with VirtualPhone(serial="envphone", root=tmp_path / "p", agent=agent, auth=False) as p:
        d = AdbDevice(TcpTransport("127.0.0.1", p.port), default_transport_timeout_s=5.0)
        d.connect(read_timeout_s=5.0)
        try:
            release = d.shell("getprop ro.build.version.release").strip()
            fingerprint = d.shell("getprop ro.build.fingerprint").strip()
            kernel = d.shell("uname -r").strip()
            env = json.loads(d.shell("farm-agent"))
        finally:
            d.close()
    assert (env["os"], env["os_version"], env["os_build"]) == ("android", release, fingerprint)
    assert env["kernel"] == kernel and env["driver"] == "d"


def test_results_without_an_environment_still_parse_and_a_bad_one_is_refused():
    old = {"job_id": "j", "kind": "latency", "status": "succeeded", "protocol": 1}  # an older agent's result
    assert from_dict(JobResult, old).environment is None
    env = RunEnvironment(os="android", os_version="14", driver="512.3", runtime={"kind": "browser", "name": "Chrome",
                                                                                 "version": "131.0"})
    result = from_dict(JobResult, old | {"environment": to_dict(env)})
    assert result.environment == env
    with pytest.raises(ProtocolError, match=r"JobResult\.environment: unknown field\(s\) gpu_mood"):
        from_dict(JobResult, old | {"environment": to_dict(env) | {"gpu_mood": "grumpy"}})
    with pytest.raises(ProtocolError, match=r"environment\.clocks_mhz\.gpu: expected a number"):
        from_dict(JobResult, old | {"environment": to_dict(env) | {"clocks_mhz": {"gpu": "fast"}}})
