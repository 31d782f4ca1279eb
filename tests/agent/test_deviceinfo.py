"""DeviceInfo parsers on captures modelled on real devices (Pixel 7 / Tensor G2 Mali-G710 on
Android 14, Galaxy S23 Ultra / Snapdragon 8 Gen 2 Adreno 740 on Android 14, Xiaomi Mi 9 on
Android 10 with thermal HAL 1.0), malformed input, and collection through a fake shell."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from agent import deviceinfo as di
from agent.protocol import Battery, DeviceInfo, ThermalReading, ThermalZone, from_json, to_json

DATA = Path(__file__).parent / "data"
ADAPTER = {"vendor": "arm", "architecture": "valhall", "device": "Mali-G710"}


def sample(name: str) -> str:
    return (DATA / name).read_text()


# ---- getprop --------------------------------------------------------------------------------


def test_getprop_pixel7():
    props = di.parse_getprop(sample("pixel7.getprop.txt"))
    assert props["ro.product.model"] == "Pixel 7"
    assert props["ro.soc.model"] == "GS201"
    assert props["ro.hardware.vulkan"] == "mali"
    assert props["vendor.gpu.cl_vendor"] == ""  # empty values are kept


def test_getprop_skips_malformed_lines():
    props = di.parse_getprop(sample("s23ultra.getprop.txt"))
    assert props["ro.product.model"] == "SM-S918B"
    assert "ro.truncated" not in props
    assert all(not k.startswith("this") for k in props)
    assert di.parse_getprop("") == {}
    assert di.parse_getprop("garbage\n[x]\n: [y]") == {}


# ---- dumpsys battery ------------------------------------------------------------------------


@pytest.mark.parametrize("name, level, celsius, status, plugged", [
    ("pixel7", 71.0, 31.8, "charging", "usb"),
    ("s23ultra", 100.0, 29.6, "full", "ac"),
    ("android10", 58.0, 27.4, "discharging", "unplugged"),
])
def test_battery(name, level, celsius, status, plugged):
    b = di.parse_dumpsys_battery(sample(f"{name}.battery.txt"))
    assert b == Battery(level_percent=level, celsius=celsius, status=status, plugged=plugged)


def test_battery_scale_words_and_garbage():
    b = di.parse_dumpsys_battery("  level: 50\n  scale: 200\n  status: Charging\n  temperature: -52\n")
    assert (b.level_percent, b.status, b.celsius, b.plugged) == (25.0, "charging", -5.2, None)
    assert di.parse_dumpsys_battery("level: abc\ntemperature: hot\nno colon") == Battery(status=None)
    assert di.parse_dumpsys_battery("Can't find service: battery") == Battery()


# ---- dumpsys thermalservice -----------------------------------------------------------------


def test_thermalservice_pixel7_android14():
    status, zones = di.parse_dumpsys_thermalservice(sample("pixel7.thermalservice.txt"))
    assert status == 1
    by_name = {z.name: z for z in zones}
    assert by_name["G3D"].celsius == pytest.approx(55.21)
    assert by_name["G3D"].source == "dumpsys thermalservice (gpu)"
    assert by_name["VIRTUAL-SKIN"].source.endswith("(skin)")
    # BCL readings (voltage, state of charge) and NaN are not temperatures
    assert "vbat" not in by_name and "soc" not in by_name and "usb_pwr_therm2" not in by_name
    # thresholds and cooling devices are not read as temperatures; the HAL section wins
    assert len(zones) == 10


def test_thermalservice_s23ultra_drops_absent_sensors():
    status, zones = di.parse_dumpsys_thermalservice(sample("s23ultra.thermalservice.txt"))
    assert status == 0
    assert [z.name for z in zones] == ["AP", "BAT", "SKIN", "PA", "DISPLAY", "WIFI"]  # USB=0.0 dropped


def test_thermalservice_android10_hal10():
    status, zones = di.parse_dumpsys_thermalservice(sample("android10.thermalservice.txt"))
    assert status == 0
    assert len(zones) == 11
    assert max(z.celsius for z in zones) == pytest.approx(41.9)


def test_thermalservice_falls_back_to_cached_and_survives_garbage():
    text = ("Thermal Status: 2\nCached temperatures:\n\tTemperature{mValue=44.0, mType=3, mName=skin, mStatus=2}\n"
            "HAL Ready: false\n")
    status, zones = di.parse_dumpsys_thermalservice(text)
    assert status == 2 and zones == [ThermalZone("skin", 44.0, "dumpsys thermalservice (skin)")]
    assert di.parse_dumpsys_thermalservice("Can't find service: thermalservice") == (-1, [])
    truncated = "Current temperatures from HAL:\n\tTemperature{mValue=3\n\tTemperature{mValue=x, mType=0, mName=a}\n"
    assert di.parse_dumpsys_thermalservice(truncated) == (-1, [])


# ---- /sys thermal, kgsl, clocks -------------------------------------------------------------


def test_sys_thermal_units_and_filters():
    zones = di.parse_sys_thermal({
        "thermal_zone10": ("xo-therm", "30700"),   # millidegrees
        "thermal_zone2": ("skin", "31"),           # whole degrees (vendor quirk)
        "thermal_zone3": ("sdr0-pa0", "-273000"),  # disabled sensor
        "thermal_zone4": ("pm8550b-ibat-lvl0", "4600"),  # a current limit, not a temperature
        "thermal_zone5": ("quiet-therm", "cat: read error: Invalid argument"),
        "thermal_zone6": ("", "41000"),            # no type: named after the zone
    })
    assert zones == [
        ThermalZone("skin", 31.0, "/sys/class/thermal/thermal_zone2"),
        ThermalZone("thermal_zone6", 41.0, "/sys/class/thermal/thermal_zone6"),
        ThermalZone("xo-therm", 30.7, "/sys/class/thermal/thermal_zone10"),
    ]


def test_temperature_and_clock_parsing():
    assert di.parse_temperature("35400") == 35.4
    assert di.parse_temperature("42") == 42.0
    assert di.parse_temperature("") is None and di.parse_temperature("N/A") is None
    assert di.parse_clock_mhz("220000000") == 220.0   # kgsl gpuclk, Hz
    assert di.parse_clock_mhz("302000") == 302.0      # Mali cur_freq, kHz
    assert di.parse_clock_mhz("850") == 850.0         # MHz
    assert di.parse_clock_mhz("1197000", unit="khz") == 1197.0
    assert di.parse_clock_mhz("0") is None and di.parse_clock_mhz("off") is None


def test_file_batch_needs_end_marker():
    assert di.parse_file_batch("/sys/a:1\n") is None
    text = "/sys/a:1\n/sys/b: x:y \n/sys/b:second line\ngrep: /sys/c: No such file\n__farm_end__\n"
    assert di.parse_file_batch(text) == {"/sys/a": "1", "/sys/b": "x:y"}


# ---- /proc, nvidia-smi ----------------------------------------------------------------------


def test_meminfo_and_cpuinfo():
    assert di.parse_meminfo(sample("s23ultra.meminfo.txt"))["MemTotal"] == 11437032 * 1024
    assert di.parse_meminfo(sample("pixel7.meminfo.txt"))["Active(anon)"] == 974532 * 1024
    assert di.parse_meminfo("MemTotal: lots\n") == {}
    assert di.parse_cpuinfo(sample("pixel7.cpuinfo.txt")) == ("", 8)  # newer kernels: no Hardware line
    assert di.parse_cpuinfo(sample("android10.cpuinfo.txt")) == ("Qualcomm Technologies, Inc SM8150", 8)
    x86 = "processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9654 96-Core Processor\n"
    assert di.parse_cpuinfo(x86) == ("AMD EPYC 9654 96-Core Processor", 2)
    assert di.parse_cpu_range("0-7") == 8
    assert di.parse_cpu_range("0-3,6-7") == 6
    assert di.parse_cpu_range("0") == 1
    assert di.parse_cpu_range("junk") == 0 and di.parse_cpu_range("") == 0


def test_nvidia_smi():
    zones, clocks = di.parse_nvidia_smi(sample("h100.nvidia-smi.txt") + "garbage\n1, X, [N/A], [N/A]\n")
    assert zones == [ThermalZone("gpu0", 34.0, "nvidia-smi (NVIDIA H100 80GB HBM3)")]
    assert clocks == {"gpu": 345.0}


# ---- collection through a shell -------------------------------------------------------------


def fake_shell(device: str, grep: bool = True):
    answers = {
        "getprop": sample(f"{device}.getprop.txt"),
        "dumpsys battery": sample(f"{device}.battery.txt"),
        "dumpsys thermalservice": sample(f"{device}.thermalservice.txt"),
        "cat /proc/meminfo": sample(f"{device}.meminfo.txt"),
        "cat /proc/cpuinfo": sample(f"{device}.cpuinfo.txt"),
    }
    files = {} if grep else dict(line.split("\t", 1) for line in sample(f"{device}.files.txt").splitlines())
    seen = []

    def shell(command: str) -> str:
        seen.append(command)
        if command.startswith("grep -s . "):
            return sample(f"{device}.sysfiles.txt") if grep else "__farm_end__\n"  # grep: not found, on stderr
        if command == "ls /sys/class/thermal":
            zones = sorted({p.split("/")[4] for p in files if p.startswith("/sys/class/thermal/")})
            return "  ".join(zones + ["cooling_device0"]) + "\n"
        if command.startswith("cat ") and command[4:] in files:
            return files[command[4:]] + "\n"
        if command in answers:
            return answers[command]
        return f"cat: {command[4:]}: No such file or directory\n"

    shell.seen = seen
    return shell


def test_collect_android_pixel7():
    shell = fake_shell("pixel7")
    info = di.collect_android(shell, ADAPTER, "28091FDH2000XY")
    assert (info.serial, info.model, info.manufacturer, info.os, info.os_version) == \
        ("28091FDH2000XY", "Pixel 7", "Google", "android", "14")
    assert info.cpu == "Google GS201" and info.cpu_cores == 8
    assert info.memory_bytes == 7768528 * 1024
    assert info.adapter == ADAPTER
    assert info.battery.celsius == 31.8
    assert info.clocks_mhz["gpu"] == 302.0 and info.clocks_mhz["cpu7"] == 2850.0
    assert list(info.clocks_mhz)[:3] == ["gpu", "cpu0", "cpu1"]
    sys_names = [z.name for z in info.thermal if z.source.startswith(di.THERMAL_DIR)]
    assert sys_names[:4] == ["BIG", "MID", "LITTLE", "G3D"]
    assert not {"vbat", "soc", "batoilo", "vdroop1", "ocp_gpu"} & set(sys_names)
    assert info.properties["ro.hardware.vulkan"] == "mali"
    assert info.properties["thermalservice.status"] == "1"
    assert di.hottest_celsius(info) == pytest.approx(55.21)
    assert len([c for c in shell.seen if c.startswith("grep")]) == 1  # one batch, not a cat per file
    assert from_json(DeviceInfo, to_json(info)) == info


def test_collect_android_s23ultra():
    info = di.collect_android(fake_shell("s23ultra"), {"vendor": "qualcomm", "device": "Adreno (TM) 740"}, "R5CW")
    assert (info.model, info.manufacturer, info.cpu) == ("SM-S918B", "samsung", "QTI SM8550")
    gpu = [z for z in info.thermal if z.source == di.KGSL_TEMP]
    assert gpu == [ThermalZone("gpu", 35.4, di.KGSL_TEMP)]
    assert info.clocks_mhz["gpu"] == 220.0
    names = {z.name for z in info.thermal}
    assert {"gpuss-0", "cpu-1-2-0", "AP", "SKIN"} <= names
    assert not {"pm8550b-ibat-lvl0", "pm8550b-vbat-lvl0", "socd", "sdr0-pa0", "quiet-therm"} & names
    assert di.hottest_celsius(info) == pytest.approx(38.9)
    assert info.battery == Battery(100.0, 29.6, "full", "ac")


def test_collect_android10_shell_without_grep():
    info = di.collect_android(fake_shell("android10", grep=False), ADAPTER, "ab12cd34")
    assert (info.model, info.os_version) == ("MI 9", "10")
    assert info.cpu == "Qualcomm Technologies, Inc SM8150"  # no ro.soc.* before Android 12
    assert info.cpu_cores == 8
    assert info.clocks_mhz == {"gpu": 257.0}
    sys_zones = {z.name: z.celsius for z in info.thermal if z.source.startswith(di.THERMAL_DIR)}
    assert sys_zones == {"aoss0-usr": 34.0, "cpu-0-0-usr": 38.5, "gpuss-0-usr": 36.8, "xo-therm-adc": 31.0}
    assert any(z.source == di.KGSL_TEMP for z in info.thermal)
    assert len([z for z in info.thermal if z.source.startswith("dumpsys")]) == 11


def test_collect_android_survives_a_dead_shell():
    def shell(command):
        raise ConnectionError("device offline")

    info = di.collect_android(shell, ADAPTER, "gone")
    assert (info.serial, info.os, info.model, info.thermal, info.battery, info.clocks_mhz) == \
        ("gone", "android", "", [], None, {})


def test_read_thermal_android_matches_collect():
    shell = fake_shell("s23ultra")
    assert di.read_thermal_android(shell) == di.collect_android(shell, ADAPTER, "x").thermal


# ---- local host and hottest -----------------------------------------------------------------


def test_collect_local_smoke():
    info = di.collect_local({"vendor": "test", "device": "none"})
    assert info.os == platform.system().lower()
    assert info.cpu_cores > 0 and info.memory_bytes > 0
    assert info.adapter == {"vendor": "test", "device": "none"}
    assert from_json(DeviceInfo, to_json(info)) == info


def test_hottest_celsius():
    assert di.hottest_celsius([]) is None
    assert di.hottest_celsius([ThermalZone("a", 30.0), ThermalZone("b", 45.5)]) == 45.5
    assert di.hottest_celsius([ThermalReading("before", "a", 39.0)]) == 39.0
    only_battery = DeviceInfo("s", "m", "x", "android", "14", {}, battery=Battery(celsius=33.0))
    assert di.hottest_celsius(only_battery) == 33.0
    empty = DeviceInfo("s", "m", "x", "android", "14", {})
    assert di.hottest_celsius(empty) is None


def test_adapter_id_names_one_gpu_on_one_machine():
    lavapipe = {"vendor_id": 65541, "device_id": 0, "backend": "Vulkan", "adapter_type": "CPU",
                "device": "llvmpipe (LLVM 15.0.6, 256 bits)", "description": "Mesa 22.3.6"}
    nvidia = lavapipe | {"vendor_id": 4318, "device_id": 8992, "adapter_type": "DiscreteGPU", "device": "H100"}
    assert di.adapter_id(lavapipe, "machine-a") == di.adapter_id(dict(lavapipe), "machine-a")  # stable
    assert len(di.adapter_id(lavapipe, "machine-a")) == 16
    assert di.adapter_id(lavapipe, "machine-a") != di.adapter_id(lavapipe, "machine-b")  # another machine
    assert di.adapter_id(lavapipe, "machine-a") != di.adapter_id(nvidia, "machine-a")  # another GPU
    # What a host's agent reports: its own machine's id, the same whatever folder it runs in
    # (a virtual phone's agent runs in the phone's folder on the same host).
    info = di.collect_local(lavapipe)
    assert info.adapter_id == di.adapter_id(lavapipe, di.machine_id())
