#!/bin/bash
# The GPU checks of the target families (issue 17), for a machine with an NVIDIA GPU and nvcc:
# builds the CUDA tests of the families' ops and of TargetCuda plus the MoE benchmark, runs the
# tests (each compares the GPU with the CPU reference and, for the HF checkpoints, with HF's
# goldens), then the benchmark. Exit code 0 = every test passed.
#   bash scripts/gpu_targets.sh            build into build-gpu-targets (BUILD_DIR), JOBS=16
# What to look for: "FAILED: none"; the printed worst tap errors per family (< 2e-2); the
# benchmark's TFLOP/s of BM_GroupedExpertGemms against BM_DenseGemmCeiling (the same work through
# cuBLASLt dense GEMMs) and the time of BM_SparseBlock, at Qwen3-30B-A3B and gpt-oss-20b shapes.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-gpu-targets}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA=ON \
      -DDFLASH_STATIC_DEPS=ON -DDFLASH_BUILD_BENCH=ON > /dev/null
tests="moe_cuda_test target_ops_cuda_test target_families_cuda_test attention_cuda_test
       linear_cuda_test train_step_cuda_test"
# shellcheck disable=SC2086
cmake --build "$build" -j"${JOBS:-16}" --target $tests
bench=1
cmake --build "$build" -j"${JOBS:-16}" --target moe_bench ||
  { bench=0; echo "moe_bench did not build (is Google Benchmark installed?); tests only"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fails=""
for t in $tests; do
  echo "=== $t"
  "$build/tests/$t" --gtest_color=no || fails="$fails $t"
done
if [[ $bench == 1 ]]; then
  echo "=== moe_bench"
  "$build/bench/moe_bench" --benchmark_counters_tabular=true || fails="$fails moe_bench"
fi
echo "FAILED:${fails:- none}"
[[ -z "$fails" ]]
