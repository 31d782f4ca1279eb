"""What a device is and how hot it runs: protocol.DeviceInfo collected from an Android phone
through a shell function (adb, the virtual phone, or Termux's own shell) or from the host the
agent runs on, the protocol.RunEnvironment a job starts in (read_environment, on the device),
plus the pure parsers for what devices print (getprop, dumpsys battery,
dumpsys thermalservice, /sys/class/thermal, kgsl, /proc/meminfo, /proc/cpuinfo, nvidia-smi).

Malformed input is skipped, never fatal: every parser keeps the lines it understands and
drops the rest (an unparsable value, an error message in place of a file, a truncated line),
so a device that lacks a command or a file still yields a DeviceInfo with what it has.
Readings that are not temperatures are dropped too: dumpsys types BCL_VOLTAGE, BCL_CURRENT
and BCL_PERCENTAGE, /sys zones that vendors use for battery current/voltage limits and
state of charge (Qualcomm's *-ibat-lvl*, *-vbat-*, *bcl*, socd; Pixel's vbat, soc, batoilo,
vdroop*, ocp*, smpl_gm), exact 0.0 (what HALs report for absent sensors) and values outside
-40..200 C. A zone's temperature text is millidegrees unless it is under 200 in magnitude,
which some vendors use for whole degrees.

Shell commands collect_android runs (the virtual phone answers these): `getprop`,
`dumpsys battery`, `dumpsys thermalservice`, `cat /proc/meminfo`, `cat /proc/cpuinfo`
(`nproc` when neither it nor /sys tells the core count), and
one `grep -s . <paths and globs> 2>/dev/null; echo __farm_end__` for the small /sys files
(grep prefixes each line with its file when given several: one adb round trip instead of
~100, and no shell loops needed). When that prints nothing usable, each file is read with a
plain `cat` and thermal zones are found with `ls /sys/class/thermal`.
"""

from __future__ import annotations

import math
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

from agent.protocol import Battery, DeviceInfo, RunEnvironment, ThermalZone

Shell = Callable[[str], str]

# android.os.Temperature TYPE_* (Android 10-14); 6-8 are battery current limit readings.
THERMAL_TYPES = {-1: "unknown", 0: "cpu", 1: "gpu", 2: "battery", 3: "skin", 4: "usb_port",
                 5: "power_amplifier", 6: "bcl_voltage", 7: "bcl_current", 8: "bcl_percentage",
                 9: "npu", 10: "tpu", 11: "display", 12: "modem", 13: "soc", 14: "wifi",
                 15: "camera", 16: "flashlight", 17: "speaker", 18: "ambient", 19: "pogo"}
_NOT_TEMPERATURE_TYPES = {6, 7, 8}
_NOT_TEMPERATURE_ZONE = re.compile(r"ibat|vbat|bcl|socd|-lvl\d|vdroop|ocp|batoilo|smpl|^soc$", re.I)
_MIN_C, _MAX_C = -40.0, 200.0

BATTERY_STATUS = {1: "unknown", 2: "charging", 3: "discharging", 4: "not charging", 5: "full"}

# getprop keys kept in DeviceInfo.properties (what tells GPUs, drivers and builds apart).
ANDROID_PROPERTIES = (
    "ro.product.brand", "ro.product.device", "ro.product.name", "ro.product.model",
    "ro.product.manufacturer", "ro.product.cpu.abi", "ro.board.platform", "ro.hardware",
    "ro.hardware.egl", "ro.hardware.vulkan", "ro.soc.manufacturer", "ro.soc.model",
    "ro.build.version.release", "ro.build.version.sdk", "ro.build.version.security_patch",
    "ro.build.fingerprint", "ro.gfx.driver.0", "ro.vendor.build.fingerprint",
)

THERMAL_DIR = "/sys/class/thermal"
KGSL_TEMP = "/sys/class/kgsl/kgsl-3d0/temp"
GPU_CLOCK_FILES = (  # first readable wins; units are guessed (see parse_clock_mhz)
    "/sys/class/kgsl/kgsl-3d0/gpuclk",
    "/sys/class/kgsl/kgsl-3d0/devfreq/cur_freq",
    "/sys/class/misc/mali0/device/cur_freq",
    "/sys/devices/platform/*.mali/cur_freq",
)
CPU_PRESENT = "/sys/devices/system/cpu/present"
CPU_FREQ_GLOB = "/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_cur_freq"
_END = "__farm_end__"


# ---- parsers --------------------------------------------------------------------------------


def parse_getprop(text: str) -> dict[str, str]:
    """`getprop` output, "[ro.product.model]: [SM-S918B]" per line."""
    props = {}
    for line in text.splitlines():
        m = re.match(r"\s*\[([^\]]+)\]\s*:\s*\[(.*)\]\s*$", line)
        if m:
            props[m.group(1)] = m.group(2)
    return props


def parse_dumpsys_battery(text: str) -> Battery:
    """`dumpsys battery`: level/scale, temperature in tenths of a degree, status as a code
    (BatteryManager.BATTERY_STATUS_*) or a word, and which of AC/USB/Wireless/Dock powers it."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition(":")
        if sep:
            values[key.strip().lower()] = value.strip()
    battery = Battery()
    level, scale = _number(values.get("level")), _number(values.get("scale"))
    if level is not None:
        battery.level_percent = round(100.0 * level / scale, 1) if scale else level
    tenths = _number(values.get("temperature"))
    if tenths is not None:
        battery.celsius = tenths / 10.0
    status = values.get("status")
    if status is not None:
        code = _number(status)
        battery.status = BATTERY_STATUS.get(int(code), "unknown") if code is not None else status.lower()
    powered = [name for name in ("ac", "usb", "wireless", "dock") if f"{name} powered" in values]
    if powered:
        on = [name for name in powered if values[f"{name} powered"].lower() == "true"]
        battery.plugged = ",".join(on) if on else "unplugged"
    return battery


def parse_dumpsys_thermalservice(text: str) -> tuple[int, list[ThermalZone]]:
    """`dumpsys thermalservice` (Android 10+): the overall status (0 none .. 6 shutdown; -1 when
    absent) and the temperatures of the "Current temperatures from HAL:" section, or of
    "Cached temperatures:" when the HAL section is empty (HAL 1.0 devices)."""
    status = -1
    sections: dict[str, list[ThermalZone]] = {}
    section = ""
    for line in text.splitlines():
        stripped = line.strip()
        m = re.match(r"Thermal Status:\s*(-?\d+)", stripped)
        if m:
            status = int(m.group(1))
            continue
        if stripped.endswith(":") and "{" not in stripped:
            section = stripped[:-1]
            continue
        m = re.match(r"Temperature\{(.*)\}$", stripped)
        if not m:
            continue
        fields = dict(kv.split("=", 1) for kv in m.group(1).split(", ") if "=" in kv)
        zone = _hal_temperature(fields)
        if zone is not None:
            sections.setdefault(section, []).append(zone)
    zones = sections.get("Current temperatures from HAL") or sections.get("Cached temperatures") or []
    return status, zones


def _hal_temperature(fields: dict[str, str]) -> ThermalZone | None:
    value, kind, name = _number(fields.get("mValue")), _number(fields.get("mType")), fields.get("mName")
    if value is None or not name or (kind is not None and int(kind) in _NOT_TEMPERATURE_TYPES):
        return None
    if not _plausible(value):
        return None
    type_name = THERMAL_TYPES.get(int(kind), "unknown") if kind is not None else "unknown"
    return ThermalZone(name=name, celsius=value, source=f"dumpsys thermalservice ({type_name})")


def parse_sys_thermal(zones: dict[str, tuple[str, str]]) -> list[ThermalZone]:
    """/sys/class/thermal zones, {"thermal_zone3": (type text, temp text)} -> readings named
    after the zone's type. Temp text is millidegrees, or whole degrees when under 200."""
    out = []
    for zone, (type_text, temp_text) in sorted(zones.items(), key=lambda kv: _natural(kv[0])):
        name = type_text.strip() or zone
        if _NOT_TEMPERATURE_ZONE.search(name):
            continue
        celsius = parse_temperature(temp_text)
        if celsius is not None:
            out.append(ThermalZone(name=name, celsius=celsius, source=f"{THERMAL_DIR}/{zone}"))
    return out


def parse_temperature(text: str) -> float | None:
    """One sysfs temperature (thermal zone, kgsl temp): millidegrees, or degrees under 200."""
    value = _number(text.strip()) if text else None
    if value is None:
        return None
    celsius = value if abs(value) < 200 else value / 1000.0
    return celsius if _plausible(celsius) else None


def parse_clock_mhz(text: str, unit: str = "auto") -> float | None:
    """A clock file's value in MHz. `unit` hz, khz or mhz; "auto" guesses from the magnitude,
    which works for GPU and CPU clocks (100 MHz .. 10 GHz): over 1e7 is Hz, over 1e4 kHz."""
    value = _number(text.strip()) if text else None
    if value is None or value <= 0:
        return None
    if unit == "auto":
        unit = "hz" if value > 1e7 else "khz" if value > 1e4 else "mhz"
    scale = {"hz": 1e-6, "khz": 1e-3, "mhz": 1.0}[unit]
    return round(value * scale, 3)


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo -> {"MemTotal": bytes, ...} (kB lines scaled to bytes)."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"(\w[\w()]*):\s+(\d+)(?:\s+kB)?\s*$", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if line.rstrip().endswith("kB") else 1)
    return out


def parse_cpuinfo(text: str) -> tuple[str, int]:
    """/proc/cpuinfo -> (name, logical cores). The name is the `Hardware` line (older ARM
    kernels), else `model name` (x86, some ARM), else ""; cores count `processor` entries."""
    hardware = model = ""
    cores = 0
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip().lower(), value.strip()
        if key == "processor" and value.isdigit():
            cores += 1
        elif key == "hardware" and not hardware:
            hardware = value
        elif key == "model name" and not model:
            model = value
    return hardware or model, cores


def parse_cpu_range(text: str) -> int:
    """/sys/devices/system/cpu/present ("0-7", "0-3,6-7") -> number of CPUs; 0 if unreadable."""
    count = 0
    for part in text.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            return 0
        count += (int(m.group(2)) - int(m.group(1)) + 1) if m.group(2) else 1
    return count


def parse_nvidia_smi(text: str) -> tuple[list[ThermalZone], dict[str, float]]:
    """`nvidia-smi --query-gpu=index,name,temperature.gpu,clocks.sm --format=csv,noheader,nounits`."""
    zones, clocks = [], {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or not parts[0].isdigit():
            continue
        index, name, temp, clock = parts
        celsius = _number(temp)
        if celsius is not None and _plausible(celsius):
            zones.append(ThermalZone(name=f"gpu{index}", celsius=celsius, source=f"nvidia-smi ({name})"))
        mhz = _number(clock)
        if mhz is not None and mhz > 0:
            clocks[f"gpu{index}" if index != "0" else "gpu"] = mhz
    return zones, clocks


def parse_file_batch(text: str) -> dict[str, str] | None:
    """Output of `grep -s . <files>; echo __farm_end__` ("/path:content" lines) -> {path:
    content}; None when the end marker is missing (the command did not run). Our paths hold
    no ':', so the first one ends the path."""
    if _END not in text:
        return None
    out = {}
    for line in text.splitlines():
        path, sep, value = line.partition(":")
        if sep and path.startswith("/") and " " not in path:
            out.setdefault(path, value.strip())
    return out


# ---- collection -----------------------------------------------------------------------------


def collect_android(shell: Shell, adapter: dict, serial: str) -> DeviceInfo:
    """DeviceInfo of an Android device through `shell` (command -> output). A command that
    fails or is missing only leaves its fields empty."""
    props = parse_getprop(_run(shell, "getprop"))
    files = _read_android_files(shell)
    cpu_name, cpuinfo_cores = parse_cpuinfo(_run(shell, "cat /proc/cpuinfo"))
    status, hal_zones = parse_dumpsys_thermalservice(_run(shell, "dumpsys thermalservice"))
    battery = parse_dumpsys_battery(_run(shell, "dumpsys battery"))
    properties = {k: props[k] for k in ANDROID_PROPERTIES if props.get(k)}
    if status >= 0:
        properties["thermalservice.status"] = str(status)
    soc = " ".join(filter(None, (props.get("ro.soc.manufacturer"), props.get("ro.soc.model"))))
    return DeviceInfo(
        serial=serial,
        model=props.get("ro.product.model", ""),
        manufacturer=props.get("ro.product.manufacturer", ""),
        os="android",
        os_version=props.get("ro.build.version.release", ""),
        adapter=adapter,
        cpu=soc or cpu_name or props.get("ro.board.platform", ""),
        cpu_cores=parse_cpu_range(files.get(CPU_PRESENT, "")) or cpuinfo_cores or _nproc(shell),
        memory_bytes=parse_meminfo(_run(shell, "cat /proc/meminfo")).get("MemTotal", 0),
        thermal=_android_zones(files) + hal_zones,
        battery=battery if battery != Battery() else None,
        clocks_mhz=_clocks(files),
        properties=properties,
        agent_version=_agent_version(),
    )


def read_thermal_android(shell: Shell) -> list[ThermalZone]:
    """Only the temperatures (for cool-down polling): /sys zones, kgsl and the thermal HAL."""
    return _android_zones(_read_android_files(shell)) + \
        parse_dumpsys_thermalservice(_run(shell, "dumpsys thermalservice"))[1]


def _android_zones(files: dict[str, str]) -> list[ThermalZone]:
    zones: dict[str, tuple[str, str]] = {}
    for path, value in files.items():
        m = re.fullmatch(re.escape(THERMAL_DIR) + r"/(thermal_zone\d+)/(type|temp)", path)
        if m:
            type_text, temp_text = zones.get(m.group(1), ("", ""))
            zones[m.group(1)] = (value, temp_text) if m.group(2) == "type" else (type_text, value)
    out = parse_sys_thermal(zones)
    gpu = parse_temperature(files.get(KGSL_TEMP, ""))
    if gpu is not None:
        out.append(ThermalZone(name="gpu", celsius=gpu, source=KGSL_TEMP))
    return out


def _clocks(files: dict[str, str]) -> dict[str, float]:
    clocks = {}
    for pattern in GPU_CLOCK_FILES:
        regex = re.compile(re.escape(pattern).replace(r"\*", "[^/]+"))
        for path, value in sorted(files.items()):
            mhz = parse_clock_mhz(value) if regex.fullmatch(path) else None
            if mhz is not None and "gpu" not in clocks:
                clocks["gpu"] = mhz
    for path, value in files.items():
        m = re.fullmatch(r"/sys/devices/system/cpu/(cpu\d+)/cpufreq/scaling_cur_freq", path)
        mhz = parse_clock_mhz(value, unit="khz") if m else None
        if mhz is not None:
            clocks[m.group(1)] = mhz
    return dict(sorted(clocks.items(), key=lambda kv: (kv[0] != "gpu", _natural(kv[0]))))


def _read_android_files(shell: Shell) -> dict[str, str]:
    globs = [f"{THERMAL_DIR}/thermal_zone*/type", f"{THERMAL_DIR}/thermal_zone*/temp", KGSL_TEMP,
             *GPU_CLOCK_FILES, CPU_PRESENT, CPU_FREQ_GLOB]
    batch = parse_file_batch(_run(shell, f"grep -s . {' '.join(globs)} 2>/dev/null; echo {_END}"))
    if batch:
        return batch
    # No grep (or it printed nothing): one cat per file, zones found by listing.
    files = {}
    zones = [n for n in _run(shell, f"ls {THERMAL_DIR}").split() if re.fullmatch(r"thermal_zone\d+", n)]
    paths = [f"{THERMAL_DIR}/{z}/{leaf}" for z in zones for leaf in ("type", "temp")]
    for path in paths + [KGSL_TEMP, CPU_PRESENT, *(p for p in GPU_CLOCK_FILES if "*" not in p)]:
        value = _run(shell, f"cat {path}").strip()
        if value and "No such file" not in value and "Permission denied" not in value:
            files[path] = value
    return files


def _nproc(shell: Shell) -> int:
    text = _run(shell, "nproc").strip()
    return int(text) if text.isdigit() else 0


def _run(shell: Shell, command: str) -> str:
    try:
        return shell(command) or ""
    except Exception:  # a missing command or a refused read is not fatal; the field stays empty
        return ""


def machine_id() -> str:
    """This machine's identity: systemd's /etc/machine-id (or D-Bus's), else the host name."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        value = _read(path).strip()
        if value:
            return value
    return platform.node() or "localhost"


def adapter_id(adapter: dict, machine: str | None = None) -> str:
    """The physical adapter `adapter` (a DeviceCaps dict) is on this machine: a short hash of
    the machine's identity and the adapter's. The virtual phones of a host and the host's own
    device report the same id, because their work runs on the same GPU."""
    import hashlib

    keys = ("vendor_id", "device_id", "backend", "adapter_type", "device", "description")
    identity = "\n".join([machine or machine_id(), *(str(adapter.get(k, "")) for k in keys)])
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def collect_local(adapter: dict | None = None) -> DeviceInfo:
    """DeviceInfo of the host the agent runs on (Linux, macOS, Windows)."""
    if adapter is None:
        from engine.device import get_gpu

        adapter = get_gpu().caps.as_dict()
    system = platform.system().lower()
    model, manufacturer, cpu, memory = "", "", "", 0
    if system == "linux":
        model = _read("/sys/class/dmi/id/product_name") or _read("/sys/firmware/devicetree/base/model").strip("\x00")
        manufacturer = _read("/sys/class/dmi/id/sys_vendor")
        cpu = parse_cpuinfo(_read("/proc/cpuinfo"))[0]
        memory = parse_meminfo(_read("/proc/meminfo")).get("MemTotal", 0)
    elif system == "darwin":
        model, manufacturer = _command(["sysctl", "-n", "hw.model"]), "Apple"
        cpu = _command(["sysctl", "-n", "machdep.cpu.brand_string"])
        memory = int(_number(_command(["sysctl", "-n", "hw.memsize"])) or 0)
    if not memory and hasattr(os, "sysconf"):
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            memory = 0
    thermal, clocks = read_thermal_local(with_clocks=True)
    return DeviceInfo(
        serial=platform.node() or "localhost",
        model=model or platform.machine(),
        manufacturer=manufacturer,
        os=system,
        os_version=_local_os_version(system),
        adapter=adapter,
        cpu=cpu or platform.processor(),
        cpu_cores=os.cpu_count() or 0,
        memory_bytes=memory,
        thermal=thermal,
        battery=_local_battery(),
        clocks_mhz=clocks,
        properties={"machine": platform.machine(), "kernel": platform.release(),
                    "python": platform.python_version()},
        adapter_id=adapter_id(adapter) if adapter else "",
        agent_version=_agent_version(),
    )


def _local_os_version(system: str) -> str:
    return (platform.mac_ver()[0] if system == "darwin" else "") or platform.release()


# ---- the environment of one run ------------------------------------------------------------

# Set by the virtual phone for its agent: a file holding the phone's `getprop` output (the
# agent runs on the host, where no getprop answers for the phone).
GETPROP_FILE_ENV = "FARM_AGENT_GETPROP_FILE"
ANDROID_GETPROP = "/system/bin/getprop"
# What names a physical adapter (DeviceCaps.as_dict() keys); features and limits follow from it.
ADAPTER_IDENTITY = ("vendor", "architecture", "device", "backend", "adapter_type", "vendor_id", "device_id")


def android_properties() -> dict[str, str]:
    """The system properties of the Android device this agent runs on ($FARM_AGENT_GETPROP_FILE,
    else /system/bin/getprop, which Termux can run); {} on any other system."""
    path = os.environ.get(GETPROP_FILE_ENV)
    if path:
        return parse_getprop(_read(path))
    if Path(ANDROID_GETPROP).is_file():
        return parse_getprop(_command([ANDROID_GETPROP]))
    return {}


def webgpu_runtime(kind: str = "wgpu-native") -> dict[str, str]:
    """The WebGPU runtime the engine's GPU work goes through: wgpu-native's version as loaded (the
    driver's partner in every timing), the Python binding's, and whether the engine's kernels
    keep WebGPU's run-time checks. `kind` "plan": the engine's
    plans replayed through it (engine/plan_exec.py), a series apart from the eager engine's."""
    runtime = {"kind": kind}
    try:
        from importlib.metadata import version

        import wgpu.backends.wgpu_native as native

        from engine.device import kernels_unchecked

        runtime["version"] = ".".join(str(n) for n in native.lib_version_info)
        runtime["binding"] = f"wgpu-py {version('wgpu')}"
        # WebGPU's run-time checks in the engine's kernels (off by default: 14% of SD 1.4's UNet
        # step on an H100), so a run with them is a series apart and a comparison names the change
        runtime["shader_checks"] = "off" if kernels_unchecked() else "on"
    except Exception:  # no wgpu here, or not installed as a distribution: say only what is known
        pass
    return runtime


def read_environment(adapter: dict, clocks_mhz: dict[str, float] | None = None,
                     webgpu_kind: str = "wgpu-native") -> RunEnvironment:
    """The environment a run starts in on this device: OS, its build, kernel, GPU driver and
    adapter (`adapter`, a DeviceCaps dict), the WebGPU runtime (webgpu_runtime(webgpu_kind)),
    and the clocks (`clocks_mhz` when the caller has just read them, else read now; empty where
    unreadable). Android is recognised by its properties (android_properties), whether the
    agent runs there under Termux or for the virtual phone."""
    props = android_properties()
    if props:
        system = "android"
        os_version = props.get("ro.build.version.release", "")
        os_build = props.get("ro.build.fingerprint", "")
    else:
        system = platform.system().lower()
        os_version = _local_os_version(system)
        os_build = _os_release().get("PRETTY_NAME", "") if system == "linux" else \
            platform.version() if system == "windows" else ""
    if clocks_mhz is None:
        clocks_mhz = read_thermal_local(with_clocks=True)[1]
    identity = {k: adapter[k] for k in ADAPTER_IDENTITY if k in adapter}
    return RunEnvironment(
        os=system, os_version=os_version, os_build=os_build, kernel=platform.release(),
        driver=str(adapter.get("description") or ""),
        adapter=identity | ({"adapter_id": adapter_id(adapter)} if adapter else {}),
        runtime=webgpu_runtime(webgpu_kind), clocks_mhz=dict(clocks_mhz),
    )


# A user agent's product tokens, tried in this order: a browser built on Chromium names itself
# before the Chrome/ token it also carries, and Chrome's and Firefox's iOS apps are WebKit.
_BROWSER_TOKENS = (
    ("Firefox", "Firefox"), ("FxiOS", "Firefox iOS"), ("EdgA", "Edge"), ("Edg", "Edge"),
    ("SamsungBrowser", "Samsung Internet"), ("OPR", "Opera"), ("CriOS", "Chrome iOS"),
    ("HeadlessChrome", "HeadlessChrome"), ("Chromium", "Chromium"), ("Chrome", "Chrome"),
)


def parse_user_agent(user_agent: str) -> dict[str, str]:
    """The browser a user agent names: {"name", "version"} ("Chrome", "131.0.6778.39"), from the
    first of _BROWSER_TOKENS it carries, or Safari's Version/ token; an Android WebView ("; wv)")
    is named so, with its Chrome version. {} for one not recognised. Chrome's user agent gives
    only the major version ("131.0.0.0"), headless too."""
    for token, name in _BROWSER_TOKENS:
        m = re.search(rf"(?<![\w/]){token}/([\w.]+)", user_agent)
        if m:
            if name == "Chrome" and "; wv)" in user_agent:
                name = "Android WebView"
            return {"name": name, "version": m.group(1)}
    m = re.search(r"\bVersion/([\w.]+).*\bSafari/", user_agent)
    return {"name": "Safari", "version": m.group(1)} if m else {}


def parse_user_agent_os(user_agent: str) -> tuple[str, str, str]:
    """(os, version, model) a user agent claims: ("ios", "18.6", "iPhone"), ("ipados", ...,
    "iPad"), ("android", "14", "Android"), ("darwin", "10.15.7", "Mac"), ("windows", "10.0",
    "PC"), ("linux", "", "PC"); empty strings where it says nothing. Browsers freeze parts of it
    (Chrome on Android says "Android 10; K" whatever the phone; Safari on an iPad may claim a
    Mac), so this is what the page said, not what the device is: a phone over ADB is read
    from the phone instead."""
    ua = user_agent
    for pattern, os_name, model in ((r"\biPhone OS (\d+(?:_\d+)*)", "ios", "iPhone"),
                                    (r"\biPad;.*? OS (\d+(?:_\d+)*)", "ipados", "iPad"),
                                    (r"\bAndroid (\d+(?:\.\d+)*)", "android", "Android"),
                                    (r"\bMac OS X (\d+(?:[_.]\d+)*)", "darwin", "Mac"),
                                    (r"\bWindows NT (\d+(?:\.\d+)*)", "windows", "PC")):
        m = re.search(pattern, ua)
        if m:
            return os_name, m.group(1).replace("_", "."), model
    if "Linux" in ua:
        return "linux", "", "PC"
    return "", "", ""


def browser_environment(adapter: dict, user_agent: str) -> RunEnvironment:
    """The environment of a run in a browser's page (the engine's browser executor), read on the
    host that drives it: the page's adapter (`adapter`, a DeviceCaps dict; its identity, without
    an adapter_id, which would name this host) and its driver, and the browser from its user
    agent (parse_user_agent). The OS, kernel and clocks stay empty: this host's are not the
    device's, and a user agent's OS is frozen (Chrome on any Android says "Android 10; K"); the
    farm fills them from its own reading of the device."""
    identity = {k: adapter[k] for k in ADAPTER_IDENTITY if k in adapter}
    return RunEnvironment(driver=str(adapter.get("description") or ""), adapter=identity,
                          runtime={"kind": "browser", **parse_user_agent(user_agent)})


def _os_release() -> dict[str, str]:
    """/etc/os-release as {KEY: value} (quotes removed)."""
    out = {}
    for line in _read("/etc/os-release").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip().strip('"')
    return out


def read_thermal_local(with_clocks: bool = False):
    """The host's temperatures: /sys/class/thermal where present, and NVIDIA GPUs through
    nvidia-smi when installed. With `with_clocks`, returns (zones, clocks_mhz)."""
    zones: dict[str, tuple[str, str]] = {}
    # FARM_AGENT_THERMAL_DIR replaces the zone folder: the virtual phone points its agent at
    # a copy of its own simulated zones, so cool-down reads the phone, not the host.
    override = os.environ.get("FARM_AGENT_THERMAL_DIR")
    base = Path(override or THERMAL_DIR)
    if base.is_dir():
        for zone in base.glob("thermal_zone*"):
            zones[zone.name] = (_read(zone / "type"), _read(zone / "temp"))
    thermal = parse_sys_thermal(zones)
    clocks: dict[str, float] = {}
    cpu0 = parse_clock_mhz(_read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq"), unit="khz")
    if cpu0 is not None:
        clocks["cpu0"] = cpu0
    if shutil.which("nvidia-smi") and not override:
        gpu_zones, gpu_clocks = parse_nvidia_smi(_command(
            ["nvidia-smi", "--query-gpu=index,name,temperature.gpu,clocks.sm",
             "--format=csv,noheader,nounits"]))
        thermal += gpu_zones
        clocks.update(gpu_clocks)
    return (thermal, clocks) if with_clocks else thermal


def _local_battery() -> Battery | None:
    for supply in sorted(Path("/sys/class/power_supply").glob("BAT*")):
        level = _number(_read(supply / "capacity"))
        status = _read(supply / "status").lower() or None
        if level is not None or status:
            return Battery(level_percent=level, status=status)
    return None


def hottest_celsius(info_or_zones: DeviceInfo | Iterable) -> float | None:
    """The hottest reading: of a DeviceInfo's zones and battery, or of any iterable of objects
    with `.celsius` (ThermalZone, ThermalReading). None when there is no reading."""
    if isinstance(info_or_zones, DeviceInfo):
        values = [z.celsius for z in info_or_zones.thermal]
        if info_or_zones.battery is not None and info_or_zones.battery.celsius is not None:
            values.append(info_or_zones.battery.celsius)
    else:
        values = [z.celsius for z in info_or_zones]
    values = [v for v in values if v is not None and not math.isnan(v)]
    return max(values) if values else None


# ---- helpers --------------------------------------------------------------------------------


def _number(text) -> float | None:
    if text is None:
        return None
    try:
        value = float(str(text).strip())
    except ValueError:
        return None
    return None if math.isnan(value) or math.isinf(value) else value


def _plausible(celsius: float) -> bool:
    return celsius != 0.0 and _MIN_C <= celsius <= _MAX_C


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _read(path) -> str:
    try:
        return Path(path).read_text(errors="replace").strip()
    except OSError:
        return ""


def _command(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _agent_version() -> str:
    try:
        from importlib.metadata import version

        return version("devicefarm")
    except Exception:  # running from a bundle, not an installed distribution
        return ""
