"""The phone models the virtual phone can pose as: build properties, board, SoC and thermal
zones. Identity stays honest: the manufacturer is "devicefarm", the model name starts with
"Virtual", ro.devicefarm.virtual=1 is set, and the GPU that jobs run on is the host's real
WebGPU adapter whatever the model says its SoC is."""

from __future__ import annotations

from dataclasses import dataclass

# Android's Temperature.TYPE_* constants (android.os.Temperature)
TYPE_CPU, TYPE_GPU, TYPE_BATTERY, TYPE_SKIN, TYPE_NPU = 0, 1, 2, 3, 9

# What `pm list packages` shows; of these only Chrome runs (agent/simulator/apps.py)
PACKAGES = ("android", "com.android.chrome", "com.android.settings", "com.android.shell", "com.android.systemui")


@dataclass(frozen=True)
class Zone:
    name: str  # /sys/class/thermal/thermal_zoneN/type and Temperature.mName
    type: int  # Temperature.mType
    coupling: float  # share of the SoC's rise over ambient this zone sees
    offset_c: float = 0.0


@dataclass(frozen=True)
class PhoneModel:
    market_name: str  # "Pixel 7"
    product_name: str  # ro.product.name
    device: str  # ro.product.device
    board: str  # ro.board.platform
    soc_manufacturer: str
    soc_model: str
    vulkan: str  # ro.hardware.vulkan: the GPU family the model poses as
    zones: tuple[Zone, ...]
    kgsl: bool = False  # Adreno: /sys/class/kgsl/kgsl-3d0
    gpu_model: str = ""  # kgsl gpu_model
    android_release: str = "13"
    sdk: str = "33"
    packages: tuple[str, ...] = PACKAGES  # installed apps

    @property
    def model(self) -> str:
        return f"Virtual {self.market_name}"


MODELS: dict[str, PhoneModel] = {
    m.market_name: m
    for m in (
        PhoneModel(
            market_name="Pixel 7", product_name="panther", device="panther", board="gs201",
            soc_manufacturer="Google", soc_model="GS201", vulkan="mali",
            zones=(
                Zone("BIG", TYPE_CPU, 1.0, 2.0), Zone("MID", TYPE_CPU, 0.95),
                Zone("LITTLE", TYPE_CPU, 0.85), Zone("G3D", TYPE_GPU, 1.0, 3.0),
                Zone("TPU", TYPE_NPU, 0.7), Zone("battery", TYPE_BATTERY, 0.35),
                Zone("VIRTUAL-SKIN", TYPE_SKIN, 0.5),
            ),
        ),
        PhoneModel(
            market_name="Galaxy S23 Ultra", product_name="dm3qxxx", device="dm3q", board="kalama",
            soc_manufacturer="QTI", soc_model="SM8550", vulkan="adreno",
            zones=(
                Zone("cpu-0-0-0", TYPE_CPU, 0.85), Zone("cpu-1-0-0", TYPE_CPU, 1.0, 2.0),
                Zone("gpuss-0", TYPE_GPU, 1.0, 3.0), Zone("nspss-0", TYPE_NPU, 0.7),
                Zone("battery", TYPE_BATTERY, 0.35), Zone("skin-therm", TYPE_SKIN, 0.5),
            ),
            kgsl=True, gpu_model="Adreno740v2",
        ),
    )
}


def get_model(name: str) -> PhoneModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown phone model {name!r}; known models: {', '.join(MODELS)}") from None
