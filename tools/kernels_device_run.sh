#!/bin/bash
# The device run of the tensor-core kernel issue, in one call on one H200 (logs under $OUT):
#   1. attention_cuda_test (both kernel families against the CPU reference, determinism),
#   2. `dflash bench --preset qwen3-8b` (the reference batch: per-phase and per-kernel figures),
#   3. train_step_cuda_test and trainer_cuda_test (GPU vs CPU step parity, bit-identical resume and
#      graphs on/off),
#   4. while time is left: Nsight Compute on the attention kernels at the reference shapes (stall
#      reasons per issued instruction), then
#      compute-sanitizer memcheck and racecheck on small attention cases.
# Layout of DIR (default .dev/kernels, carried to the device): bin.tar.xz (dflash and the test
# binaries, built with -DDFLASH_STATIC_DEPS=ON), libs.tar.xz (the Debian libraries they link),
# this script. Run from the repository root (its assets/ hold the tiny target and the corpus):
#   bash DIR/kernels_device_run.sh [DIR]
# The binaries were built in /work/wt/kernels; their tests look for the sources (assets) and the
# dflash binary there, so the script links that path to this tree.
set -u
D=$(realpath "${1:-.dev/kernels}")
RESULT=${OUT:-/tmp/kernels-result}  # what comes back: summary.txt, bench.json, logs.tar.xz
L=/tmp/kernels-out                   # every log, packed into $RESULT/logs.tar.xz after each stage
mkdir -p "$L" "$RESULT" /tmp/kernels/bin /tmp/dflash_libs
START=$(date +%s)
log() {
  echo "=== $(date +%T) +$(($(date +%s) - START)) s $*" | tee -a "$L/summary.txt"
  tar -C /tmp -cJf "$RESULT/logs.tar.xz" kernels-out 2>/dev/null
  cp "$L/summary.txt" "$RESULT/"
  [ -f "$L/bench.json" ] && cp "$L/bench.json" "$RESULT/"
}
tar -C /tmp/dflash_libs -xJf "$D/libs.tar.xz"
tar -C /tmp/kernels/bin -xJf "$D/bin.tar.xz"
export LD_LIBRARY_PATH=/tmp/dflash_libs:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
B=/tmp/kernels/bin
W=/work/wt/kernels
mkdir -p $W/build-static
[ -e $W/assets ] || ln -s "$PWD/assets" $W/assets
[ -e $W/configs ] || ln -s "$PWD/configs" $W/configs
ln -sf $B/dflash $W/build-static/dflash
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader \
  | tee -a "$L/summary.txt"

run_test() {  # name, timeout, extra args
  local t=$1 lim=$2
  shift 2
  local s=$(date +%s%N)
  timeout "$lim" "$B/$t" --gtest_color=no "$@" > "$L/$t.log" 2>&1
  local rc=$?
  echo "$t rc=$rc $(( ($(date +%s%N) - s) / 1000000 )) ms" >> "$L/summary.txt"
  grep -E "^\[  (FAILED|PASSED) |Failure|rel_error|Expected|Which is|Value of|  Actual" "$L/$t.log" \
    | head -40 >> "$L/summary.txt"
}

log "1. attention_cuda_test"
run_test attention_cuda_test 60

log "2. dflash bench --preset qwen3-8b"
timeout 130 $B/dflash bench --preset qwen3-8b --json "$L/bench.json" > "$L/bench.txt" 2>&1
echo "bench exit $?" >> "$L/summary.txt"
tail -24 "$L/bench.txt" >> "$L/summary.txt"

log "3. train_step_cuda_test, trainer_cuda_test"
run_test train_step_cuda_test 60
run_test trainer_cuda_test 60

if [ $(($(date +%s) - START)) -lt 120 ]; then
  log "4. Nsight Compute, with stall reasons: one drafter forward, one dq, one dk/dv"
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout 60 "$NCU" --clock-control none -k regex:'attn_tc_(fwd|dq|dkdv)' --launch-skip 38 \
    --launch-count 3 --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section SchedulerStats \
    --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum,dram__bytes.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
    $B/dflash bench --preset qwen3-8b --steps 1 --warmup 0 --graphs off --kernel-reps 1 \
    > "$L/ncu.txt" 2>&1
  echo "ncu rc=$?" >> "$L/summary.txt"
  grep -E "attn_tc_|Duration|hmma|lts__t_bytes|dram__bytes|Warp Cycles Per Issued|Issued Warp Per|No Eligible|Active Warps Per|Eligible Warps Per" \
    "$L/ncu.txt" | head -60 >> "$L/summary.txt"
  awk '/attn_tc_/ {print} /issue_stalled/ && $NF+0 >= 0.3 {print}' "$L/ncu.txt" | head -60 \
    >> "$L/summary.txt"
fi

CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
SMALL='AttentionCuda.EmptyRowsGiveZeroAndMinusInf:AttentionCuda.DFlashTrainingPattern:AttentionCuda.OddShapes'
if [ $(($(date +%s) - START)) -lt 180 ]; then
  log "5. compute-sanitizer memcheck (small attention cases)"
  timeout 40 "$CS" --tool memcheck --error-exitcode 3 "$B/attention_cuda_test" \
    --gtest_filter="$SMALL" > "$L/memcheck.log" 2>&1
  echo "memcheck rc=$?" >> "$L/summary.txt"
  tail -4 "$L/memcheck.log" >> "$L/summary.txt"
fi
if [ $(($(date +%s) - START)) -lt 200 ]; then
  log "6. compute-sanitizer racecheck (two small attention cases)"
  timeout 35 "$CS" --tool racecheck --error-exitcode 3 "$B/attention_cuda_test" \
    --gtest_filter='AttentionCuda.EmptyRowsGiveZeroAndMinusInf:AttentionCuda.DFlashTrainingPattern' \
    > "$L/racecheck.log" 2>&1
  echo "racecheck rc=$?" >> "$L/summary.txt"
  tail -4 "$L/racecheck.log" >> "$L/summary.txt"
fi
log "done"
