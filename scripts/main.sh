#!/usr/bin/env bash
# The main job on the embedded default: install, build, then run on assets/tiny-qwen3 and assets/data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target dflash
./build/dflash inspect assets/tiny-qwen3
