"""What a run ran on, as the control plane reads it: the identity of a run's environment (the
protocol.RunEnvironment an agent sends, as a dict) that series are keyed by, its short key
(Run.env_key), its label in a series key, the changes between two environments in words
("driver changed 512.3 -> 530.1"), and the environment a device's record gives for a result
that came without one. Plain functions over dicts: the store and the analysis both use them.

The identity is os, os_version, os_build, kernel, driver, the WebGPU runtime and the adapter's
identity: what changes a run's numbers without the build changing. Clocks are left out (they
move from run to run and are kept as readings), and so is the profile: the build ships it, so
a new profile is the build's change, reported as the build's; the series key has the profile
the job asked for beside this key.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

ENVIRONMENT_KEY_CHARS = 16
# What names a physical adapter; the same list as agent.deviceinfo.ADAPTER_IDENTITY.
ADAPTER_IDENTITY = ("vendor", "architecture", "device", "backend", "adapter_type", "vendor_id", "device_id")
DEVICE_RECORD = "device-record"  # RunEnvironment.source of an environment filled from the device's record
NOT_RECORDED = "(not recorded)"


def identity(env: dict[str, Any]) -> dict[str, Any]:
    """The fields of an environment that say whether two runs ran in the same one, as strings."""
    adapter = env.get("adapter") or {}
    return {
        "os": str(env.get("os") or ""),
        "os_version": str(env.get("os_version") or ""),
        "os_build": str(env.get("os_build") or ""),
        "kernel": str(env.get("kernel") or ""),
        "driver": str(env.get("driver") or ""),
        "runtime": {str(k): str(v) for k, v in sorted((env.get("runtime") or {}).items())},
        "adapter": {k: str(adapter[k]) for k in ADAPTER_IDENTITY if adapter.get(k) not in (None, "")},
    }


def environment_key(env: dict[str, Any]) -> str:
    """A short hash of identity(env): equal for runs in one environment (Run.env_key)."""
    text = json.dumps(identity(env), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:ENVIRONMENT_KEY_CHARS]


def label(env: dict[str, Any]) -> str:
    """"<os> <os_version> / <driver>": the readable part of a series key (SeriesKey.os_driver)."""
    os_part = f"{env.get('os') or ''} {env.get('os_version') or ''}".strip()
    return " / ".join(p for p in (os_part, str(env.get("driver") or "")) if p)


def runtime_label(runtime: dict[str, Any]) -> str:
    """wgpu-native 29.0.1.1, Chrome 131.0.6778.39, ... ("" when nothing was recorded)."""
    if not runtime:
        return ""
    name = runtime.get("name") or runtime.get("kind") or "runtime"
    return f"{name} {runtime.get('version', '')}".strip()


def adapter_label(adapter: dict[str, Any]) -> str:
    parts = [str(adapter.get(k) or "") for k in ("vendor", "device", "backend")]
    return " ".join(p for p in parts if p)


def describe(env: dict[str, Any]) -> dict[str, str]:
    """The environment as short readable lines, field -> text (what `farm results show` prints)."""
    clocks = env.get("clocks_mhz") or {}
    profile = env.get("profile") or {}
    lines = {
        "os": f"{env.get('os') or ''} {env.get('os_version') or ''}".strip(),
        "os build": str(env.get("os_build") or ""),
        "kernel": str(env.get("kernel") or ""),
        "driver": str(env.get("driver") or ""),
        "adapter": adapter_label(env.get("adapter") or {}),
        "runtime": runtime_label(env.get("runtime") or {}),
        "clocks": ", ".join(f"{k} {v:g} MHz" for k, v in clocks.items()),
        "profile": " ".join(p for p in (str(profile.get("name") or ""),
                                         f"sha256 {profile['sha256'][:12]}" if profile.get("sha256") else "") if p),
        "recorded by": {"agent": "the agent, at run time",
                        DEVICE_RECORD: "the device's record (the agent sent none)"}.get(
                            str(env.get("source") or ""), str(env.get("source") or "")),
    }
    return {k: v for k, v in lines.items() if v}


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between two environments, one phrase per change, in the order of
    identity(): ["driver changed 512.3 -> 530.1", ...]; [] when they are the same. A field
    one side did not record reads "(not recorded)": the runs cannot be said to match."""
    a, b = identity(before), identity(after)
    out = []

    def changed(what: str, old: str, new: str) -> None:
        if old != new:
            out.append(f"{what} changed {old or NOT_RECORDED} -> {new or NOT_RECORDED}")

    changed("OS", f"{a['os']} {a['os_version']}".strip(), f"{b['os']} {b['os_version']}".strip())
    changed("OS build", a["os_build"], b["os_build"])
    changed("kernel", a["kernel"], b["kernel"])
    changed("driver", a["driver"], b["driver"])
    if a["runtime"] != b["runtime"]:
        old, new = runtime_label(a["runtime"]), runtime_label(b["runtime"])
        if old == new:  # the same name and version, another binding
            old, new = json.dumps(a["runtime"], sort_keys=True), json.dumps(b["runtime"], sort_keys=True)
        changed("WebGPU runtime", old, new)
    if a["adapter"] != b["adapter"]:
        old, new = adapter_label(a["adapter"]), adapter_label(b["adapter"])
        if old == new:
            old, new = json.dumps(a["adapter"], sort_keys=True), json.dumps(b["adapter"], sort_keys=True)
        changed("adapter", old, new)
    if out and (before.get("source") == DEVICE_RECORD) != (after.get("source") == DEVICE_RECORD):
        side = "baseline" if before.get("source") == DEVICE_RECORD else "candidate"
        out.append(f"the {side}'s environment is the device's record, not the run's (its agent sent none)")
    return out


def from_device_record(*, os: str, os_version: str, driver: str, info: dict[str, Any] | None,
                       profile: str = "") -> dict[str, Any]:
    """The environment a device's record gives (for a result whose agent sent none): OS and
    driver as recorded, the adapter and the OS build or kernel its last DeviceInfo holds, no
    runtime and no clocks (neither is known for that run), and `profile` (the name the result's
    engine section reports), marked source "device-record"."""
    info = info or {}
    adapter = info.get("adapter") or {}
    props = info.get("properties") or {}
    identity_part = {k: adapter[k] for k in ADAPTER_IDENTITY if k in adapter}
    if info.get("adapter_id"):
        identity_part["adapter_id"] = info["adapter_id"]
    return {"os": os or "", "os_version": os_version or "", "os_build": props.get("ro.build.fingerprint", ""),
            "kernel": props.get("kernel", ""), "driver": driver or "", "adapter": identity_part, "runtime": {},
            "clocks_mhz": {}, "profile": {"name": profile} if profile else {}, "source": DEVICE_RECORD}
