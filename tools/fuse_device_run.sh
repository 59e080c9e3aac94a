#!/bin/bash
# The device run of issue 13's fusions (branch fuse): the CUDA op tests of the fused and rewritten
# kernels, the training-step tests, `dflash bench --preset qwen3-8b` and the GEMM shapes of the
# step (bench/cuda/gemm_bench.cpp), in one call.
#
#   bash tools/fuse_device_run.sh --stage DIR   (here) stage the stripped binaries of BUILD_DIR
#                                                (default build), the runtime libraries they load
#                                                (LIBS, a libs tar.xz) and this script
#   bash DIR/fuse_device_run.sh DIR             (on the GPU machine, from the repository root)
#
# What to read in $OUT/summary.txt: one line per test binary (rc=0 and the PASSED count; the
# fused ops' bit-for-bit tests are RmsNormCuda.BackwardFusedWithTheResidualGradient,
# RopeCuda.NormThenRopeFused, SwigluCuda.VectorAndScalarPathsGiveTheSameBits and
# LinearCuda.MatchesCpu), the bench's phase table (target forward, drafter forward, CE, drafter
# backward, AdamW, the step, tokens/s, plan vs measured memory) and gemm_bench's table.
set -u
TESTS="rmsnorm_cuda_test rope_cuda_test swiglu_cuda_test linear_cuda_test cross_entropy_cuda_test
  optimizer_cuda_test train_step_cuda_test trainer_cuda_test target_ops_cuda_test
  target_families_cuda_test"
if [[ "${1:-}" == "--stage" ]]; then
  set -e
  dir=${2:?usage: fuse_device_run.sh --stage DIR}
  build=${BUILD_DIR:-build}
  mkdir -p "$dir/bin"
  strip -o "$dir/bin/dflash" "$build/dflash"
  strip -o "$dir/bin/gemm_bench" "$build/bench/gemm_bench"
  for t in $TESTS; do strip -o "$dir/bin/$t" "$build/tests/$t"; done
  tar -C "$dir" -cJf "$dir/bin.tar.xz" bin && rm -r "$dir/bin"
  cp "${LIBS:?LIBS: a tar.xz of the Debian runtime libraries the binaries load}" "$dir/libs.tar.xz"
  cp "$0" "$dir/fuse_device_run.sh"
  exit 0
fi
D=$(realpath "${1:?usage: fuse_device_run.sh DIR}"); R=${OUT:-/tmp/fuse-result}; L=/tmp/fuse-out
mkdir -p "$R" "$L" /tmp/fuse/libs
START=$(date +%s)
log() { echo "=== $(date +%T) +$(($(date +%s) - START)) s $*" | tee -a $L/summary.txt; cp $L/summary.txt "$R/"; }
tar -C /tmp/fuse -xJf "$D/bin.tar.xz"; tar -C /tmp/fuse/libs -xJf "$D/libs.tar.xz"
export LD_LIBRARY_PATH=/tmp/fuse/libs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export DFLASH_TEST_SOURCE_DIR=$PWD DFLASH_TEST_BINARY=/tmp/fuse/bin/dflash NCCL_NVLS_ENABLE=0
B=/tmp/fuse/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $L/summary.txt
ldd $B/dflash $B/gemm_bench | grep "not found" >> $L/summary.txt
run_test() {  # binary, timeout in s
  local s=$(date +%s); timeout "$2" $B/$1 --gtest_color=no > $L/$1.log 2>&1; local rc=$?
  echo "$1 rc=$rc $(($(date +%s) - s)) s $(grep -E '^\[  (PASSED|SKIPPED|FAILED)  \]' $L/$1.log | tr '\n' ' ')" >> $L/summary.txt
  grep -E "^\[  FAILED  \]|Failure$|Expected|Which is|Value of|Actual" $L/$1.log | head -12 >> $L/summary.txt
  cp $L/summary.txt "$R/"
}
log "op tests"
for t in rmsnorm_cuda_test rope_cuda_test swiglu_cuda_test linear_cuda_test \
  cross_entropy_cuda_test optimizer_cuda_test; do run_test $t 30; done
log "step tests"
run_test train_step_cuda_test 60
run_test trainer_cuda_test 60
log "dflash bench --preset qwen3-8b"
timeout 80 $B/dflash bench --preset qwen3-8b --json $L/bench_8b.json > $L/bench_8b.txt 2>&1
echo "bench exit $?" >> $L/summary.txt; cat $L/bench_8b.txt >> $L/summary.txt
cp $L/bench_8b.json "$R/" 2>/dev/null
log "gemm_bench"
timeout 45 $B/gemm_bench > $L/gemm_bench.txt 2>&1
echo "gemm_bench exit $?" >> $L/summary.txt; cat $L/gemm_bench.txt >> $L/summary.txt
log "target tests"
run_test target_ops_cuda_test 30
run_test target_families_cuda_test 40
log done
tar -C /tmp -cJf "$R/logs.tar.xz" fuse-out 2>/dev/null
