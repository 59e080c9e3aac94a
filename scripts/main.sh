#!/usr/bin/env bash
# The main job on the embedded default: install, build, train a 1-layer drafter on the bundled tiny
# Qwen3 target and corpus (CPU backend), then measure τ with speculative decoding on held-out
# prompts (greedy, checked lossless against the target alone).
#   RUN_DIR (default runs/default)  where the run lives; an existing finished run is evaluated again
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/default}
bash scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target dflash
if ls "$RUN_DIR"/checkpoint-*/COMPLETE >/dev/null 2>&1; then
  echo "main: $RUN_DIR already holds a checkpoint; continuing it (finished runs return at once)"
  ./build/dflash train --resume "$RUN_DIR"
else
  ./build/dflash train output_dir="$RUN_DIR"
fi
CKPT=$(ls -d "$RUN_DIR"/checkpoint-* | sort -t- -k2 -n | tail -1)
./build/dflash eval --target assets/tiny-qwen3 --drafter "$CKPT" \
  --prompts assets/data/eval_prompts.jsonl --per-source 20 --max-new-tokens 64 \
  --output "$RUN_DIR/eval.json"
