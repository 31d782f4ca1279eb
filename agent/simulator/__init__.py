"""The virtual phone: a process that speaks the device side of ADB over TCP (CNXN, RSA AUTH,
OPEN/OKAY/WRTE/CLSE, shell v1 and v2, exec, sync v1 and v2), keeps a sandboxed filesystem
that shell and sync both see, answers getprop, dumpsys and /sys thermal files from a thermal
model and `screencap -p` with a PNG of its screen (screen.py), relays Chrome's DevTools socket
(localabstract:chrome_devtools_remote) to its headless Chromium, and runs the real `farm-agent`
on the host's real WebGPU adapter. adb-shell and
Google's `adb` both work against it; tests and the demo use it instead of phones."""

from agent.simulator.phone import VirtualPhone, run_simulator

__all__ = ["VirtualPhone", "run_simulator"]
