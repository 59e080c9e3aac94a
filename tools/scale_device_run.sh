#!/bin/bash
# The device run of the real-scale issue, in one call on one H200 (logs and JSON under $OUT):
#   1. the CUDA tests that cover the changed code (staged binaries),
#   2. `dflash bench --preset qwen3-8b` (the reference batch, random weights, graphs off and on),
#   3. a random-weight Qwen3-8B-shaped checkpoint + long conversations (make_q8b.py), then
#      `dflash train --plan` and 50 steps of `dflash train` at the reference batch,
#   4. the tiny reference run (configs/tiny-reference.yaml: simulated τ and wall time),
#   5. the PyTorch reference trainer's step at the same shapes (peer_step.py, SpecForge).
# Layout of DIR (default .dev/scale, carried to the device): bin.tar.xz (dflash and the test
# binaries, stripped), libs.tar.xz (OpenBLAS and the other Debian libraries the binaries link),
# this script, make_q8b.py, peer_step.py, qwen3-tokenizer/, peer.tar.xz (specforge + its
# qwen3-8b config), qwen3-8b-reference.yaml. Run from the repository root (its assets/ hold the
# corpus and the tiny target): bash DIR/scale_device_run.sh [DIR]
# The binaries were built in /work/wt/scale; their tests look for the sources (assets) and the
# dflash binary there, so the script links that path to this tree.
set -u
D=$(realpath "${1:-.dev/scale}")
RESULT=${OUT:-/tmp/scale-result}  # what comes back: summary.txt, bench.json, logs.tar.xz
OUT=/tmp/scale-out                # every log, packed into $RESULT/logs.tar.xz after each stage
mkdir -p "$OUT" "$RESULT" /tmp/scale/bin /tmp/dflash_libs
log() {
  echo "=== $(date +%T) $*" | tee -a "$OUT/summary.txt"
  tar -C /tmp -cJf "$RESULT/logs.tar.xz" scale-out 2>/dev/null
  cp "$OUT/summary.txt" "$RESULT/"
  [ -f "$OUT/bench.json" ] && cp "$OUT/bench.json" "$RESULT/"
}
tar -C /tmp/dflash_libs -xJf "$D/libs.tar.xz"
tar -C /tmp/scale/bin -xJf "$D/bin.tar.xz"
export LD_LIBRARY_PATH=/tmp/dflash_libs:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
B=/tmp/scale/bin
mkdir -p /work/wt /work/wt/scale/build
[ -e /work/wt/scale/assets ] || ln -s "$PWD/assets" /work/wt/scale/assets
[ -e /work/wt/scale/configs ] || ln -s "$PWD/configs" /work/wt/scale/configs
ln -sf $B/dflash /work/wt/scale/build/dflash
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader \
  | tee -a "$OUT/summary.txt"

log "1. CUDA tests"
fails=""
for t in $B/*_test; do
  s=$(date +%s%N)
  if ! timeout 300 "$t" --gtest_color=no >> "$OUT/tests.log" 2>&1; then fails="$fails $(basename $t)"; fi
  echo "$(basename $t) $(( ($(date +%s%N) - s) / 1000000 )) ms" >> "$OUT/summary.txt"
done
log "tests failed:${fails:- none}"

log "2. dflash bench --preset qwen3-8b"
timeout 300 $B/dflash bench --preset qwen3-8b --plan > "$OUT/bench_plan.txt" 2>&1
timeout 300 $B/dflash bench --preset qwen3-8b --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
echo "bench exit $?" >> "$OUT/summary.txt"
tail -22 "$OUT/bench.txt" >> "$OUT/summary.txt"

log "3. Qwen3-8B-shaped checkpoint, reference batch training"
mkdir -p runs
timeout 200 python3 "$D/make_q8b.py" runs/q8b-target runs/q8b-data.jsonl \
  --tokenizer "$D/qwen3-tokenizer" --corpus assets/data/train.jsonl.xz --records 300 \
  > "$OUT/make_q8b.log" 2>&1
tail -2 "$OUT/make_q8b.log" >> "$OUT/summary.txt"
timeout 60 $B/dflash train --config "$D/qwen3-8b-reference.yaml" --plan > "$OUT/train_plan.txt" 2>&1
echo "train --plan exit $?" >> "$OUT/summary.txt"
nvidia-smi --query-gpu=memory.used --format=csv,noheader -lms 500 > "$OUT/train_mem.csv" &
smi=$!
timeout 400 $B/dflash train --config "$D/qwen3-8b-reference.yaml" > "$OUT/train.log" 2>&1
echo "train exit $?" >> "$OUT/summary.txt"
kill $smi
grep -E "device memory|step 50|step 10/|step 20/|error|arena|total " "$OUT/train.log" >> "$OUT/summary.txt"
echo "nvidia-smi peak used: $(sort -n "$OUT/train_mem.csv" | tail -1)" >> "$OUT/summary.txt"
cp runs/q8b-reference/metrics.jsonl "$OUT/train_metrics.jsonl" 2>/dev/null

log "4. tiny reference run"
s=$(date +%s)
timeout 200 $B/dflash train --config configs/tiny-reference.yaml output_dir=runs/tiny-reference \
  > "$OUT/tiny.log" 2>&1
echo "tiny exit $? wall $(( $(date +%s) - s )) s" >> "$OUT/summary.txt"
grep -E "step 1200|elapsed|finished" "$OUT/tiny.log" | tail -3 >> "$OUT/summary.txt"

log "5. PyTorch reference step (SpecForge)"
mkdir -p /tmp/peerx && tar -C /tmp/peerx -xJf "$D/peer.tar.xz"
PYTHONUNBUFFERED=1 timeout 240 python3 "$D/peer_step.py" --specforge /tmp/peerx/peer \
  --drafter-config /tmp/peerx/peer/configs/qwen3-8b-dflash.json > "$OUT/peer.log" 2>&1
echo "peer exit $?" >> "$OUT/summary.txt"
grep RESULT "$OUT/peer.log" >> "$OUT/summary.txt"
log "done"
