#!/bin/bash
# The device run of the integration of scale (issue 12), targets (issue 17) and kernels (issue 13),
# in one call on one H200: every CUDA test binary, `dflash bench --preset qwen3-8b` once, then
# `dflash train` on the CUDA backend for 6 steps against the MoE goldens.
# Logs under $OUT: summary.txt (one line per test binary, failures, the bench table),
# logs.tar.xz (every log), bench.json.
# Staging here (DIR = .dev/integrate of the checkout the device receives; carry it):
#   ninja -C build dflash $(cd tests/cuda && ls *_test.cpp | sed 's/\.cpp$//')
#   strip each of build/dflash and build/tests/<cuda test> into a folder, tar -cJf DIR/bin.tar.xz;
#   DIR/libs.tar.xz = the non-system libraries `ldd` lists for them (fmt, spdlog, yaml-cpp,
#   utf8proc, OpenBLAS with gfortran/quadmath, pcre2, zstd, lzma; CUDA comes with the machine).
# Run from the repository root (its assets/ and tests/fixtures/ are the tests' fixtures; the
# binaries look for them under the build tree's source path /work/wt/integrate, linked here):
#   bash DIR/integrate_device_run.sh [DIR]     (TESTS="a_test b_test", BENCH=0,
#   FAMILIES=0 narrow it)
set -u
D=$(realpath "${1:-.dev/integrate}"); R=${OUT:-/tmp/integrate-result}; L=/tmp/integrate-out
mkdir -p $R $L /tmp/integrate/bin /tmp/dflash_libs
START=$(date +%s)
log() {
  echo "=== $(date +%T) +$(($(date +%s) - START)) s $*" | tee -a $L/summary.txt
  tar -C /tmp -cJf $R/logs.tar.xz integrate-out 2>/dev/null; cp $L/summary.txt $R/
}
tar -C /tmp/dflash_libs -xJf $D/libs.tar.xz; tar -C /tmp/integrate/bin -xJf $D/bin.tar.xz
CUDA_LIBS=/usr/local/cuda/lib64:/usr/local/cuda/lib
export LD_LIBRARY_PATH=/tmp/dflash_libs:$CUDA_LIBS:${LD_LIBRARY_PATH:-}
B=/tmp/integrate/bin; W=/work/wt/integrate
mkdir -p $W/build /work/wt/shared
for d in assets tests configs; do [ -e $W/$d ] || ln -s "$PWD/$d" $W/$d; done
ln -sf $B/dflash $W/build/dflash
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  | tee -a $L/summary.txt
TESTS=${TESTS:-$(cd $B && ls *_test)}
log "CUDA tests: $TESTS"
for t in $TESTS; do
  s=$(date +%s)
  timeout ${TLIM:-120} $B/$t --gtest_color=no > $L/$t.log 2>&1; rc=$?
  verdict=$(grep -E '^\[  (PASSED|SKIPPED|FAILED)  \]' $L/$t.log | tr '\n' ' ')
  echo "$t rc=$rc $(($(date +%s) - s)) s $verdict" >> $L/summary.txt
  grep -E "^\[  FAILED  \]|Failure|Expected|Which is|Value of|Actual|error" $L/$t.log \
    | head -30 >> $L/summary.txt
done
log "tests done"
if [ "${BENCH:-1}" = 1 ]; then
  timeout 150 $B/dflash bench --preset qwen3-8b --json $L/bench.json > $L/bench.txt 2>&1
  echo "bench exit $?" >> $L/summary.txt; tail -30 $L/bench.txt >> $L/summary.txt
  cp $L/bench.json $R/ 2>/dev/null
fi
if [ "${FAMILIES:-1}" = 1 ]; then
  # `dflash train` on the CUDA backend against every family's golden (as tests/family_train_test
  # does on the CPU): 6 steps of a 1-layer drafter; the target and drafter share the plan's arena.
  # The MoE goldens only: the dense ones have head_dim 16 or 32, which the CUDA attention refuses.
  xz -dc assets/data/train.jsonl.xz | head -200 > /tmp/integrate/train.jsonl
  for f in qwen3-moe qwen3-moe-window gpt-oss gpt-oss-mxfp4; do
    T=/tmp/integrate/fam/$f; rm -rf $T; mkdir -p $T/target
    for x in tests/fixtures/models/$f/*; do
      [ "$(basename $x)" = golden.safetensors ] || ln -s "$PWD/$x" $T/target/
    done
    cp tests/fixtures/byte-tokenizer/tokenizer.json $T/target/
    printf '%s\n' "model:" "  target: $T/target" "  drafter_layers: 1" "  intermediate_size: 64" \
      "  mask_token_id: 300" "data:" "  train_file: /tmp/integrate/train.jsonl" \
      "  template: chatml" "  max_length: 256" "  token_budget: 256" "  rows_per_step: 2" \
      "training:" "  max_steps: 6" "  lr: 3.0e-3" "  warmup_ratio: 0.0" "  num_anchors: 4" \
      "  block_size: 4" "  seed: 5" "  log_interval: 1" "  save_interval: 6" "runtime:" \
      "  backend: cuda" "output_dir: $T/run" > $T/run.yaml
    timeout 60 $B/dflash train --config $T/run.yaml > $L/train-$f.log 2>&1; rc=$?
    echo "train $f rc=$rc loss $(grep -o '"loss":[0-9.e+-]*' $T/run/metrics.jsonl 2>/dev/null \
      | cut -d: -f2 | tr '\n' ' ')" >> $L/summary.txt
    [ $rc = 0 ] || tail -5 $L/train-$f.log >> $L/summary.txt
  done
fi
log "done"
