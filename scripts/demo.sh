#!/usr/bin/env bash
# The main job on a fresh machine with no configuration: make a tiny random-weight model and
# generate an image from a prompt with it on this machine's WebGPU adapter.
set -euo pipefail
cd "$(dirname "$0")/.."
# Mesa's Vulkan drivers print "XDG_RUNTIME_DIR is invalid" errors without one; give them a private one.
[ -n "${XDG_RUNTIME_DIR:-}" ] || export XDG_RUNTIME_DIR="$(mktemp -d)"
bash scripts/bootstrap.sh
model=models/tiny
[ -f "$model/model_index.json" ] || .venv/bin/farm engine make-model --preset tiny --seed 0 --out "$model"
exec .venv/bin/farm engine generate --model "$model" --prompt "a red bicycle leaning on a wall" \
  --steps 20 --seed 0 --out out/tiny.png "$@"
