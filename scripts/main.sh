#!/usr/bin/env bash
# The main job on the embedded default: install, build, train a 1-layer drafter on the bundled tiny
# Qwen3 target and corpus, then measure τ with speculative decoding on held-out prompts (greedy,
# checked lossless against the target alone; `dflash eval` runs on the CPU backend).
#   With a GPU (nvidia-smi lists one) and nvcc: CUDA build in build/, training on the GPU.
#   Without: CPU-only build in build-cpu/ (no nvcc compile), training on the CPU backend.
#   RUN_DIR (default runs/default)  where the run lives; an existing finished run is evaluated again
#   DFLASH_BACKEND=cpu              train on the CPU even when a GPU is present
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/default}
start=$(date +%s)
bash scripts/setup.sh

gpu=""
why_no_gpu="no nvidia-smi"
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu=$(nvidia-smi -L 2>/dev/null | grep -m1 '^GPU ' || true)
  why_no_gpu="nvidia-smi lists none"
fi
nvcc=""
if command -v nvcc >/dev/null 2>&1; then
  nvcc=$(command -v nvcc)
elif [ -x /usr/local/cuda/bin/nvcc ]; then
  nvcc=/usr/local/cuda/bin/nvcc
fi
if [ "${DFLASH_BACKEND:-}" = cpu ]; then
  echo "main: DFLASH_BACKEND=cpu: CPU-only build, training on the CPU backend"
  gpu=""
elif [ -n "$gpu" ] && [ -n "$nvcc" ]; then
  echo "main: ${gpu%% (UUID*}, nvcc $nvcc: CUDA build, training on the GPU (runtime.backend=cuda)"
elif [ -n "$gpu" ]; then
  echo "main: ${gpu%% (UUID*} but no nvcc: CPU-only build, training on the CPU backend"
  gpu=""
else
  echo "main: no GPU ($why_no_gpu): CPU-only build, training on the CPU backend" \
    "($(nproc) threads)"
fi
if [ -n "${OPENBLAS_CORETYPE:-}" ]; then
  echo "main: note: OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE is set in this environment, so OpenBLAS" \
    "uses those kernels for the CPU work instead of detecting the CPU's own"
fi

if [ -n "$gpu" ]; then
  build=build
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$nvcc" >/dev/null
  train_args=(runtime.backend=cuda)
else
  build=build-cpu
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA=OFF \
    -DDFLASH_BUILD_TESTS=OFF -DDFLASH_BUILD_BENCH=OFF >/dev/null
  train_args=()
fi
cmake --build "$build" -j "$(nproc)" --target dflash
built=$(date +%s)

if ls "$RUN_DIR"/checkpoint-*/COMPLETE >/dev/null 2>&1; then
  echo "main: $RUN_DIR already holds a checkpoint; continuing it (finished runs return at once)"
  "./$build/dflash" train --resume "$RUN_DIR"
else
  "./$build/dflash" train output_dir="$RUN_DIR" "${train_args[@]}"
fi
trained=$(date +%s)
CKPT=$(ls -d "$RUN_DIR"/checkpoint-* | sort -t- -k2 -n | tail -1)
"./$build/dflash" eval --target assets/tiny-qwen3 --drafter "$CKPT" \
  --prompts assets/data/eval_prompts.jsonl --per-source 20 --max-new-tokens 64 \
  --output "$RUN_DIR/eval.json"
done_at=$(date +%s)
echo "main: setup and build $((built - start)) s, training $((trained - built)) s," \
  "eval $((done_at - trained)) s, total $((done_at - start)) s"
