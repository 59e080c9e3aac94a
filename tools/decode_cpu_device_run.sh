#!/bin/bash
# The CPU decoding figures of issue 16 on the H200 machine's 16 cores (where `dflash eval` ran
# with system time 2.8× user time before parallel_threads() cached the CPU count): the tiny
# reference drafter is trained on the GPU (configs/tiny-reference.yaml, ~25 s), then `dflash eval`
# on the CPU backend at batch sizes 1, 8 and 16 (same prompts: the outputs must agree), and
# `dflash regenerate` of 1,000 corpus records twice (the same bytes) at batch 16.
# Logs under $OUT: summary.txt (per run: user/system seconds, minor faults, wall time, tokens/s,
# τ, lossless; records/s), eval_b*.json, logs.tar.xz.
# Staging here (DIR = .dev/<name> of the checkout the device receives; carry it):
#   ninja -C build dflash; strip it into a folder, tar -cJf DIR/bin.tar.xz;
#   DIR/libs.tar.xz = the non-system libraries `ldd build/dflash` lists (as integrate_device_run).
# Run from the repository root: bash DIR/decode_cpu_device_run.sh [DIR]   (PROMPTS=N: --limit)
set -u
D=$(realpath "${1:-.dev/decode}"); R=${OUT:-/tmp/decode-result}; L=/tmp/decode-out
mkdir -p $R $L /tmp/decode/bin /tmp/dflash_libs
START=$(date +%s)
log() {
  echo "=== $(date +%T) +$(($(date +%s) - START)) s $*" | tee -a $L/summary.txt
  tar -C /tmp -cJf $R/logs.tar.xz decode-out 2>/dev/null; cp $L/summary.txt $R/
}
tar -C /tmp/dflash_libs -xJf $D/libs.tar.xz; tar -C /tmp/decode/bin -xJf $D/bin.tar.xz
export LD_LIBRARY_PATH=/tmp/dflash_libs:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
B=/tmp/decode/bin/dflash
echo "$(nproc) cores; $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee -a $L/summary.txt

log "train the tiny reference drafter (GPU)"
$B train --config configs/tiny-reference.yaml output_dir=/tmp/decode/run > $L/train.log 2>&1 \
  || { tail -5 $L/train.log >> $L/summary.txt; log "train failed"; exit 1; }
DR=$(ls -d /tmp/decode/run/checkpoint-* | sort -t- -k2 -n | tail -1)

# "user U sys S faults F wall W" of a command's /usr/bin/time line.
timed() { /usr/bin/time -f "user %U sys %S faults %R wall %e" "$@"; }
for b in 1 8 16; do
  log "eval batch $b"
  timed $B --log-level warn eval --target assets/tiny-qwen3 --drafter $DR \
    --prompts assets/data/eval_prompts.jsonl --limit ${PROMPTS:-150} --per-source 66 \
    --max-new-tokens 96 --batch-size $b --output $R/eval_b$b.json > $L/eval_b$b.log 2>&1
  grep -E "^tau:|tokens/s|speedup|lossless|^user" $L/eval_b$b.log >> $L/summary.txt
done
python3 - "$R" >> $L/summary.txt <<'EOF'
import json, sys
rows = {b: [(p["id"], p["new_tokens"], p["accept_histogram"])
            for p in json.load(open(f"{sys.argv[1]}/eval_b{b}.json"))["prompts"]] for b in (1, 8, 16)}
print("eval outputs equal across batch sizes:", rows[1] == rows[8] == rows[16])
EOF

xz -dc assets/data/train.jsonl.xz | head -1000 > /tmp/decode/in1000.jsonl
for r in 1 2; do
  log "regenerate 1,000 records, run $r"
  timed $B --log-level warn regenerate --target assets/tiny-qwen3 --data /tmp/decode/in1000.jsonl \
    --out /tmp/decode/regen$r.jsonl --temperature 0.7 --seed 1 --batch-size 16 \
    > $L/regen$r.log 2>&1
  grep -E "written|records/s|tokens/s|^user" $L/regen$r.log >> $L/summary.txt
done
cmp -s /tmp/decode/regen1.jsonl /tmp/decode/regen2.jsonl && echo "regenerate reruns identical" \
  >> $L/summary.txt || echo "regenerate reruns DIFFER" >> $L/summary.txt
log done
