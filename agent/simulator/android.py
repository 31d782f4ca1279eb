"""What the virtual phone says about itself, in real Android's formats: system properties
(`getprop`), `dumpsys battery` and `dumpsys thermalservice` (Android 13 layouts), the
/sys/class/thermal zones, /sys/class/kgsl for Adreno models and /proc/version. Every
temperature comes from the thermal model at the moment it is read."""

from __future__ import annotations

import platform

from agent.simulator.models import PhoneModel
from agent.simulator.thermal import ThermalModel

# android.os.PowerManager thermal status thresholds, applied to the skin temperature
SKIN_STATUS_C = (39.0, 41.0, 43.0, 45.0, 47.0, 50.0)  # >= each: LIGHT, MODERATE, ..., SHUTDOWN
BATTERY_LEVEL = 87

ABIS = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "arm64-v8a", "arm64": "arm64-v8a"}


class AndroidState:
    def __init__(self, model: PhoneModel, serial: str, thermal: ThermalModel, auth: bool):
        self.model = model
        self.serial = serial
        self.thermal = thermal
        uname = platform.uname()
        self.kernel_release = uname.release
        self.machine = uname.machine
        abi = ABIS.get(uname.machine.lower(), uname.machine.lower())
        m = model
        self.props: dict[str, str] = {
            "ro.product.manufacturer": "devicefarm",
            "ro.product.brand": "devicefarm",
            "ro.product.model": m.model,
            "ro.product.name": m.product_name,
            "ro.product.device": m.device,
            "ro.product.board": m.board,
            "ro.board.platform": m.board,
            "ro.hardware": m.device,
            "ro.hardware.vulkan": m.vulkan,
            "ro.soc.manufacturer": m.soc_manufacturer,
            "ro.soc.model": m.soc_model,
            "ro.product.cpu.abi": abi,
            "ro.product.cpu.abilist": abi,
            "ro.build.version.release": m.android_release,
            "ro.build.version.sdk": m.sdk,
            "ro.build.id": "VIRTUAL",
            "ro.build.type": "user",
            "ro.build.tags": "release-keys",
            "ro.build.fingerprint": f"devicefarm/{m.product_name}/{m.device}:{m.android_release}/VIRTUAL/1:user/release-keys",
            "ro.build.characteristics": "default",
            "ro.serialno": serial,
            "ro.boot.serialno": serial,
            "ro.debuggable": "0",
            "ro.secure": "1",
            "ro.adb.secure": "1" if auth else "0",
            "ro.devicefarm.virtual": "1",
            "sys.boot_completed": "1",
            "service.adb.root": "0",
            "persist.sys.timezone": "UTC",
        }

    # ---- identity -----------------------------------------------------------------------

    def banner(self) -> bytes:
        m = self.model
        return (f"device::ro.product.name={m.product_name};ro.product.model={m.model};"
                f"ro.product.device={m.device};features=shell_v2,cmd,stat_v2,ls_v2,fixed_push_mkdir").encode()

    def getprop(self, name: str | None = None) -> str:
        if name is not None:
            return self.props.get(name, "") + "\n"
        return "".join(f"[{k}]: [{v}]\n" for k, v in sorted(self.props.items()))

    def uname(self, flags: str = "-s") -> str:
        fields = {"s": "Linux", "n": "localhost", "r": self.kernel_release,
                  "v": "#1 SMP PREEMPT devicefarm virtual", "m": self.machine}
        if "a" in flags:
            return " ".join(fields[k] for k in "snrvm") + " Toybox\n"
        keys = [k for k in "snrvm" if k in flags] or ["s"]
        return " ".join(fields[k] for k in keys) + "\n"

    # ---- thermal ------------------------------------------------------------------------

    def zone_celsius(self) -> list[tuple[str, int, float]]:
        return [(z.name, z.type, self.thermal.zone_celsius(z.coupling, z.offset_c)) for z in self.model.zones]

    def battery_celsius(self) -> float:
        for name, _, c in self.zone_celsius():
            if name == "battery":
                return c
        return self.thermal.zone_celsius(0.35)

    def thermal_status(self) -> int:
        skins = [c for _, t, c in self.zone_celsius() if t == 3]
        skin = max(skins) if skins else self.thermal.zone_celsius(0.5)
        return sum(skin >= limit for limit in SKIN_STATUS_C)

    def dumpsys(self, service: str) -> tuple[str, int]:
        if service == "battery":
            return self._dumpsys_battery(), 0
        if service == "thermalservice":
            return self._dumpsys_thermalservice(), 0
        return f"Can't find service: {service}\n", 0

    def _dumpsys_battery(self) -> str:
        tenths = round(self.battery_celsius() * 10)
        return (
            "Current Battery Service state:\n"
            "  AC powered: false\n"
            "  USB powered: true\n"
            "  Wireless powered: false\n"
            "  Max charging current: 500000\n"
            "  Max charging voltage: 5000000\n"
            "  Charge counter: 3958000\n"
            "  status: 2\n"
            "  health: 2\n"
            "  present: true\n"
            f"  level: {BATTERY_LEVEL}\n"
            "  scale: 100\n"
            "  voltage: 4312\n"
            f"  temperature: {tenths}\n"
            "  technology: Li-ion\n"
        )

    def _dumpsys_thermalservice(self) -> str:
        status = self.thermal_status()

        def temps() -> str:
            return "".join(
                f"\tTemperature{{mValue={c:.1f}, mType={t}, mName={name}, mStatus={status if t == 3 else 0}}}\n"
                for name, t, c in self.zone_celsius()
            )

        listeners = "\tcallbacks: 1\n\tkilled: false\n\tbroadcasts count: -1\n"
        return (
            "IsStatusOverride: false\n"
            f"ThermalEventListeners:\n{listeners}"
            f"ThermalStatusListeners:\n{listeners}"
            f"Thermal Status: {status}\n"
            f"Cached temperatures:\n{temps()}"
            "HAL Ready: true\n"
            "HAL connection:\n"
            "\tThermalHAL AIDL 1  connected: yes\n"
            f"Current temperatures from HAL:\n{temps()}"
            "Current cooling devices from HAL:\n"
            "\tCoolingDevice{mValue=0, mType=2, mName=thermal-cpufreq-0}\n"
            "\tCoolingDevice{mValue=0, mType=3, mName=thermal-gpufreq-0}\n"
        )

    # ---- virtual files ------------------------------------------------------------------

    def virtual_files(self) -> dict:
        files = {}
        for i, zone in enumerate(self.model.zones):
            base = f"/sys/class/thermal/thermal_zone{i}"
            files[f"{base}/type"] = _const(zone.name + "\n")
            files[f"{base}/temp"] = self._millis(zone.coupling, zone.offset_c)
            files[f"{base}/mode"] = _const("enabled\n")
        files["/sys/class/power_supply/battery/temp"] = lambda: f"{round(self.battery_celsius() * 10)}\n".encode()
        files["/sys/class/power_supply/battery/capacity"] = _const(f"{BATTERY_LEVEL}\n")
        files["/sys/class/power_supply/battery/status"] = _const("Charging\n")
        if self.model.kgsl:
            gpu = next((z for z in self.model.zones if z.type == 1), None)
            kgsl = "/sys/class/kgsl/kgsl-3d0"
            files[f"{kgsl}/temp"] = self._millis(gpu.coupling if gpu else 1.0, gpu.offset_c if gpu else 0.0)
            files[f"{kgsl}/gpu_model"] = _const(self.model.gpu_model + "\n")
            files[f"{kgsl}/gpuclk"] = self._gpuclk
            files[f"{kgsl}/max_gpuclk"] = _const("680000000\n")
            files[f"{kgsl}/devfreq/cur_freq"] = self._gpuclk
            files[f"{kgsl}/gpu_busy_percentage"] = lambda: f"{90 if self.thermal.running_jobs else 0} %\n".encode()
        files["/proc/version"] = lambda: f"Linux version {self.kernel_release} (devicefarm virtual phone)\n".encode()
        return files

    def _millis(self, coupling: float, offset_c: float):
        return lambda: f"{round(self.thermal.zone_celsius(coupling, offset_c) * 1000)}\n".encode()

    def _gpuclk(self) -> bytes:
        return b"680000000\n" if self.thermal.running_jobs else b"220000000\n"


def _const(text: str):
    data = text.encode()
    return lambda: data
