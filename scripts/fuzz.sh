#!/usr/bin/env bash
# Builds the libFuzzer harnesses of tests/fuzz (clang, CPU backend, ASan+UBSan, in build-fuzz/)
# and runs each for SECONDS (default 60), from its seed corpus tests/fuzz/corpus/<name> plus what
# earlier runs found (build-fuzz/corpus/<name>). Prints libFuzzer's execution count per harness;
# fails when any harness finds a crash, leak, UB, timeout or out-of-memory, whose input is saved
# under build-fuzz/findings/<name>/ (replay: build-fuzz/tests/fuzz/fuzz_<name> FILE).
#   bash scripts/fuzz.sh [SECONDS] [NAME ...]    (no NAME: every harness)
#   FUZZ_JOBS=N      harnesses run at once (default: the number of cores)
#   FUZZ_ARGS="..."  extra libFuzzer flags (e.g. "-runs=10000000")
#   FUZZ_BUILD_DIR   build folder (default build-fuzz)
#   DFLASH_WERROR    warnings as errors (CI sets it)
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-60}
shift || true
JOBS=${FUZZ_JOBS:-$(nproc)}
WERROR=${DFLASH_WERROR:-OFF}
B=${FUZZ_BUILD_DIR:-build-fuzz}

command -v clang++ >/dev/null || { echo "fuzz: clang++ is missing (bash scripts/setup.sh)"; exit 1; }
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DDFLASH_FUZZ=ON -DDFLASH_CUDA=OFF -DDFLASH_WERROR="$WERROR" \
  >/dev/null
cmake --build "$B" -j "$JOBS" --target fuzz_all

NAMES=("$@")
if [ ${#NAMES[@]} -eq 0 ]; then
  mapfile -t NAMES < <(ls tests/fuzz/corpus)
fi

run_one() {
  local name=$1 exe="$B/tests/fuzz/fuzz_$1"
  mkdir -p "$B/corpus/$name" "$B/findings/$name" "$B/logs"
  local log="$B/logs/$name.log"
  local rc=0
  # -timeout: seconds per input (a hang is a finding); -rss_limit_mb: an input that makes a parser
  # allocate more than this is a finding too.
  "$exe" -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$B/findings/$name/" ${FUZZ_ARGS:-} \
    "$B/corpus/$name" "tests/fuzz/corpus/$name" >"$log" 2>&1 || rc=$?
  local execs
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  if [ "$rc" -eq 0 ]; then
    echo "fuzz: $name: ${execs:-?} executions in ${SECS} s, no finding"
  else
    echo "fuzz: $name: FINDING (exit $rc) after ${execs:-?} executions; input in" \
      "$B/findings/$name/, log $log:"
    grep -E "ERROR|fuzz finding|runtime error|Test unit written" "$log" | head -5 | sed 's/^/  /'
  fi
  return "$rc"
}

fail=0
pids=()
for name in "${NAMES[@]}"; do
  [ -d "tests/fuzz/corpus/$name" ] || { echo "fuzz: no harness '$name'"; exit 1; }
  run_one "$name" &
  pids+=($!)
  if [ ${#pids[@]} -ge "$JOBS" ]; then
    wait "${pids[0]}" || fail=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || fail=1; done
exit "$fail"
