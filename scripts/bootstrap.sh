#!/usr/bin/env bash
# Prepare this checkout on a fresh Debian/Ubuntu machine: a virtual environment in .venv with
# the project installed (extras given as the first argument, e.g. "test"), and a WebGPU
# adapter (Mesa's lavapipe from apt when no GPU driver is found and apt is usable).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo "$@"; else return 1; fi; }
apt_install() {
  command -v apt-get >/dev/null || return 1
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

PY="${PYTHON:-python3}"
if ! command -v "$PY" >/dev/null; then
  apt_install python3 python3-venv || { echo "error: python3 (3.11 or newer) is required" >&2; exit 1; }
fi
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "error: Python 3.11 or newer is required ($("$PY" --version))" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    apt_install python3-venv || { echo "error: '$PY -m venv' failed; install python3-venv" >&2; exit 1; }
    "$PY" -m venv .venv
  fi
fi
# pip's and setuptools' warnings (an editable install's "be careful with folders named like the
# package", a pip.conf's missing index folders) go to a log, shown only when the install fails.
log=.venv/install.log
echo "installing devicefarm${extras:+[$extras]} into .venv (log: $log)"
if ! { .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip &&
       .venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "error: pip could not install devicefarm${extras:+[$extras]} (the log above, also in $log)" >&2
  exit 1
fi

# An adapter on a native backend: wgpu falls back to OpenGL where Mesa's GL is present, and that
# adapter has no shader-f16 and no timestamps, so it does not count.
has_adapter() {
  .venv/bin/python -c 'import sys, wgpu; a = wgpu.gpu.request_adapter_sync()
sys.exit(0 if a and a.info["backend_type"] in ("Vulkan", "Metal", "D3D12") else 1)' >/dev/null 2>&1
}
if ! has_adapter; then
  echo "no Vulkan, Metal or D3D12 adapter found: installing Mesa's lavapipe (mesa-vulkan-drivers libvulkan1)"
  if ! apt_install mesa-vulkan-drivers libvulkan1 || ! has_adapter; then
    echo "error: no WebGPU adapter. Install a Vulkan/Metal/D3D12 GPU driver, or on Debian/Ubuntu" >&2
    echo "       'apt-get install mesa-vulkan-drivers libvulkan1' for the CPU (lavapipe) adapter." >&2
    exit 1
  fi
fi
