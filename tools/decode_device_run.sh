#!/bin/bash
# The GPU runs of speculative decoding on CUDA (issue 16): the decoding tests, the fused decoding
# kernels' tests, the target-family tests (TargetCuda's layer loop is shared with the decoding
# forward), and the decode bench
# (Qwen3-8B-shaped steps at 512 context, the cuBLASLt GEMMs they are made of, tiny-fixture
# tokens/s at batch 1 and 64).
#
#   bash tools/decode_device_run.sh --stage DIR    here: build dflash, decoder_cuda_test,
#                                                  decode_fused_cuda_test,
#                                                  target_families_cuda_test and decode_cuda_bench
#                                                  (BUILD_DIR default build, JOBS default 2) and
#                                                  put them stripped, with libbenchmark, into
#                                                  DIR/bin.tar.xz
#   bash decode_device_run.sh DIR                  on the GPU machine, from the repository root
#                                                  (the script may be a copy anywhere);
#                                                  LIBS: tarballs of the Debian runtime libraries
#                                                  the machine lacks (default: the lead's
#                                                  .dev/callB/libs.tar.xz and libs_blas.tar.xz);
#                                                  logs, bench.log and summary.txt under $OUT
#
# One device call of ≈ 1 min (+ the machine's start): carry DIR and the LIBS tarballs.
# What to look for in $OUT/summary.txt:
#   decoder_cuda_test rc=0, 12 tests passed; the "leaves the CPU's tokens" lines name the
#     requests whose bf16 greedy path leaves the fp32 CPU target's at a near-tie (the gap printed
#     must be far below the row's largest logit; the test checks ≤ 2e-2 of it);
#   decode_fused_cuda_test rc=0 (4 tests), target_families_cuda_test rc=0;
#   bench: BM_TargetStep1 (one-token step), BM_TargetVerify16 (16-row verify), BM_DrafterBlock16,
#     BM_SpecStep16 at batch 1 and 8 (cuBLASLt projections, the default) and the …RowGemm lines
#     (decode_linear_cuda projections); BM_Gemm and BM_DecodeLinear weight GB/s;
#     BM_TinyTarget / BM_TinySpeculative tokens_per_s at batch 1 and 64.
set -uo pipefail

if [[ "${1:-}" == "--stage" ]]; then
  set -e
  cd "$(dirname "$0")/.."
  dir=${2:?usage: decode_device_run.sh --stage DIR}
  build=${BUILD_DIR:-build}
  cmake --build "$build" -j"${JOBS:-2}" --target dflash decoder_cuda_test \
        decode_fused_cuda_test target_families_cuda_test decode_cuda_bench
  tmp=$(mktemp -d)
  cp "$build/dflash" "$build/tests/decoder_cuda_test" "$build/tests/decode_fused_cuda_test" \
     "$build/tests/target_families_cuda_test" "$build/bench/decode_cuda_bench" "$tmp/"
  strip "$tmp"/*
  cp -L "$(ldconfig -p | awk '/libbenchmark.so.1/ {print $NF; exit}')" "$tmp/"
  mkdir -p "$dir"
  tar -C "$tmp" -cJf "$dir/bin.tar.xz" .
  rm -rf "$tmp"
  echo "staged $dir/bin.tar.xz"
  exit 0
fi

D=$(realpath "${1:?usage: decode_device_run.sh DIR}")
R=${OUT:-/tmp/decode-result}
B=/tmp/decode-run/bin L=/tmp/decode-run/libs
mkdir -p "$R" "$B" "$L"
START=$(date +%s)
log() { echo "=== $(date +%T) +$(($(date +%s) - START)) s $*" | tee -a "$R/summary.txt"; }
for t in ${LIBS:-.dev/callB/libs.tar.xz .dev/callB/libs_blas.tar.xz}; do tar -C "$L" -xJf "$t"; done
tar -C "$B" -xJf "$D/bin.tar.xz"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$R/summary.txt"
export LD_LIBRARY_PATH=$B:$L:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export DFLASH_TEST_SOURCE_DIR=$PWD DFLASH_TEST_BINARY=$B/dflash
for t in decoder_cuda_test decode_fused_cuda_test target_families_cuda_test; do
  timeout 120 "$B/$t" --gtest_color=no > "$R/$t.log" 2>&1
  echo "$t rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' "$R/$t.log" | tr '\n' ' ')" >> "$R/summary.txt"
  grep -E "^\[  FAILED  \]|Failure$|leaves the CPU" "$R/$t.log" | head -30 >> "$R/summary.txt"
  log "$t done"
done
timeout 300 "$B/decode_cuda_bench" --benchmark_counters_tabular=true > "$R/bench.log" 2>&1
echo "bench rc=$?" >> "$R/summary.txt"
grep -E "^BM_" "$R/bench.log" >> "$R/summary.txt"
log done
