#!/bin/bash
# The device run of the integration of scale (issue 12), targets (issue 17) and kernels (issue 13),
# in one call on one H200: every CUDA test binary, then `dflash bench --preset qwen3-8b` once.
# Logs under $OUT: summary.txt (one line per test binary, failures, the bench table),
# logs.tar.xz (every log), bench.json.
# Staging here (DIR = .dev/integrate of the checkout the device receives; carry it):
#   ninja -C build dflash $(cd tests/cuda && ls *_test.cpp | sed 's/\.cpp$//')
#   strip each of build/dflash and build/tests/<cuda test> into a folder, tar -cJf DIR/bin.tar.xz;
#   DIR/libs.tar.xz = the non-system libraries `ldd` lists for them (fmt, spdlog, yaml-cpp,
#   utf8proc, OpenBLAS with gfortran/quadmath, pcre2, zstd, lzma; CUDA comes with the machine).
# Run from the repository root (its assets/ and tests/fixtures/ are the tests' fixtures; the
# binaries look for them under the build tree's source path /work/wt/integrate, linked here):
#   bash DIR/integrate_device_run.sh [DIR]     (TESTS="a_test b_test" BENCH=0 to narrow it)
set -u
D=$(realpath "${1:-.dev/integrate}"); R=${OUT:-/tmp/integrate-result}; L=/tmp/integrate-out
mkdir -p $R $L /tmp/integrate/bin /tmp/dflash_libs
START=$(date +%s)
log() {
  echo "=== $(date +%T) +$(($(date +%s) - START)) s $*" | tee -a $L/summary.txt
  tar -C /tmp -cJf $R/logs.tar.xz integrate-out 2>/dev/null; cp $L/summary.txt $R/
}
tar -C /tmp/dflash_libs -xJf $D/libs.tar.xz; tar -C /tmp/integrate/bin -xJf $D/bin.tar.xz
export LD_LIBRARY_PATH=/tmp/dflash_libs:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
B=/tmp/integrate/bin; W=/work/wt/integrate
mkdir -p $W/build /work/wt/shared
for d in assets tests configs; do [ -e $W/$d ] || ln -s "$PWD/$d" $W/$d; done
ln -sf $B/dflash $W/build/dflash
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $L/summary.txt
TESTS=${TESTS:-$(cd $B && ls *_test)}
log "CUDA tests: $TESTS"
for t in $TESTS; do
  s=$(date +%s)
  timeout ${TLIM:-120} $B/$t --gtest_color=no > $L/$t.log 2>&1; rc=$?
  echo "$t rc=$rc $(($(date +%s) - s)) s $(grep -E '^\[  (PASSED|SKIPPED|FAILED)  \]' $L/$t.log | tr '\n' ' ')" >> $L/summary.txt
  grep -E "^\[  FAILED  \]|Failure|Expected|Which is|Value of|Actual|error" $L/$t.log | head -30 >> $L/summary.txt
done
log "tests done"
if [ "${BENCH:-1}" = 1 ]; then
  timeout 150 $B/dflash bench --preset qwen3-8b --json $L/bench.json > $L/bench.txt 2>&1
  echo "bench exit $?" >> $L/summary.txt; tail -30 $L/bench.txt >> $L/summary.txt
  cp $L/bench.json $R/ 2>/dev/null
fi
log "done"
