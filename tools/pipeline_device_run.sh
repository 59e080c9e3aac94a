#!/bin/bash
# The GPU runs of the pipeline (issue 14) on one GPU: the CUDA pipeline tests, the tiny reference
# trained by 1 target + 2 drafter workers colocated on GPU 0 against the single-worker run (the
# simulated τ must agree within 0.1), and a Qwen3-8B-shaped target (random weights) with 1 target + 1
# drafter worker colocated on GPU 0 for the per-stage busy fractions.
#
#   bash tools/pipeline_device_run.sh --stage DIR     here: build dflash and pipeline_cuda_test
#                                                     (Release, CUDA, static deps; BUILD_DIR default
#                                                     build-cuda, JOBS default 2) and copy into DIR
#                                                     the stripped binaries, the OpenBLAS libraries
#                                                     (libs.tar.xz) and the Qwen3 tokenizer
#   bash tools/pipeline_device_run.sh DIR [PART...]   on the GPU machine, from the repository root:
#                                                     PART is tests, tiny, q8b or all (default);
#                                                     logs and a summary under $OUT
#
# Device calls: `tests tiny` together in one (≈ 1 + 3 min), `q8b` in another (≈ 5 min with the
# model's generation). The staged folder is ignored by git: pass it to the device call as a carried
# path (carry [".dev/pipeline"]). The CUDA runtime, cuBLASLt and NCCL come from the machine's CUDA toolkit
# (the script stops naming any library `ldd` cannot find). Run directories go to /tmp; only their
# log.txt, metrics.jsonl and status.json are copied under $OUT.
#
# What to look for in $OUT/summary.txt:
#   tests  "pipeline_cuda_test: rc 0"; NcclOnTwoGpus skips on one GPU.
#   tiny   the three runs' final simulated τ: tiny-1x2 (1200 steps, two batches a step) and
#          tiny-1x2-600 (600 steps, the batches of the single run) within 0.1 of tiny-1x1; the
#          1x2 logs say "collective: cuda-local" and "the 2 drafter replicas are bit-identical".
#   q8b    target_busy and drafter_busy per logged step and the wall s/step; the status.json
#          workers (phase, memory used/total).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--stage" ]]; then
  set -e
  dir=${2:?usage: pipeline_device_run.sh --stage DIR}
  build=${BUILD_DIR:-build-cuda}
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA=ON \
        -DDFLASH_STATIC_DEPS=ON -DDFLASH_BUILD_BENCH=OFF > /dev/null
  cmake --build "$build" -j"${JOBS:-2}" --target dflash pipeline_cuda_test
  mkdir -p "$dir"
  strip -o "$dir/dflash" "$build/dflash"
  strip -o "$dir/pipeline_cuda_test" "$build/tests/pipeline_cuda_test"
  blas=$(ldd "$build/dflash" | awk '/libopenblas|libgfortran|libquadmath/ {print $3}')
  # shellcheck disable=SC2086
  tar -chJf "$dir/libs.tar.xz" --transform 's|.*/||' $blas
  tok=${DFLASH_SHARED_DIR:-../shared}/fixtures/qwen3-tokenizer
  mkdir -p "$dir/qwen3-tokenizer"
  cp "$tok/tokenizer.json.xz" "$tok/tokenizer_config.json" "$dir/qwen3-tokenizer/"
  du -sh "$dir"
  echo "staged in $dir: on the GPU machine run 'bash tools/pipeline_device_run.sh $dir'"
  exit 0
fi

bin=$(cd "${1:?usage: pipeline_device_run.sh DIR [tests|tiny|q8b|all]...}" && pwd)
shift
parts=("${@:-all}")
out=${OUT:?set OUT to the folder for the logs}
runs=/tmp/pipeline-runs
mkdir -p "$out" "$runs"
summary="$out/summary.txt"

mkdir -p /tmp/dflash_libs && tar -C /tmp/dflash_libs -xJf "$bin/libs.tar.xz"
export LD_LIBRARY_PATH=/tmp/dflash_libs:${LD_LIBRARY_PATH:-}
for b in "$bin/dflash" "$bin/pipeline_cuda_test"; do
  missing=$(ldd "$b" | awk '/not found/ {print $1}')
  if [[ -n "$missing" ]]; then
    echo "$b: libraries not found: $missing" | tee -a "$summary"
    exit 1
  fi
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$summary"

want() {
  local p
  for p in "${parts[@]}"; do [[ "$p" == all || "$p" == "$1" ]] && return 0; done
  return 1
}

# Trains `name` with the given arguments, copies its reports under $OUT/name and appends the last
# metrics record's figures and the wall time to the summary.
train() {
  local name=$1
  shift
  rm -rf "${runs:?}/$name"
  local start end rc
  start=$(date +%s.%N)
  "$bin/dflash" train "$@" output_dir="$runs/$name" > "$out/$name.stderr.txt" 2>&1
  rc=$?
  end=$(date +%s.%N)
  mkdir -p "$out/$name"
  cp "$runs/$name"/{log.txt,metrics.jsonl,status.json} "$out/$name/" 2>/dev/null
  python3 - "$name" "$rc" "$start" "$end" "$runs/$name/metrics.jsonl" >> "$summary" <<'PY'
import json, sys
name, rc, start, end, path = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
try:
    recs = [json.loads(l) for l in open(path)]
except OSError:
    recs = []
line = f"{name}: rc {rc}, wall {end - start:.1f} s"
if recs:
    r = recs[-1]
    line += (f", step {r.get('step')}, loss {r.get('loss', float('nan')):.4f}, "
             f"simulated tau {r.get('tau', float('nan')):.3f}, tokens/s {r.get('tokens_per_s', 0):.0f}")
    num = lambda v: round(v, 3) if isinstance(v, float) else v
    busy = [(x.get('step'), num(x.get('target_busy')), num(x.get('drafter_busy')),
             num(x.get('s_per_step'))) for x in recs if 'target_busy' in x]
    if busy:
        line += "\n  step, target_busy, drafter_busy, s_per_step: " + "; ".join(
            f"{s} {t} {d} {w}" for s, t, d, w in busy)
else:
    line += ", no metrics"
print(line)
PY
  grep -E "collective:|bit-identical|backend|failed|stuck|error" "$runs/$name/log.txt" \
    2>/dev/null | sed 's/^/  /' >> "$summary"
  [[ $rc == 0 ]] || tail -n 3 "$out/$name.stderr.txt" | sed 's/^/  /' >> "$summary"
}

if want tests; then
  DFLASH_TEST_SOURCE_DIR=$PWD DFLASH_TEST_BINARY=$bin/dflash \
    "$bin/pipeline_cuda_test" --gtest_color=no > "$out/pipeline_cuda_test.log" 2>&1
  echo "pipeline_cuda_test: rc $?" >> "$summary"
  grep -E '^\[ +(OK|FAILED|SKIPPED) +\].*\([0-9]+ ms\)$' "$out/pipeline_cuda_test.log" |
    sed 's/^/  /' >> "$summary"
fi

if want tiny; then
  cfg=configs/tiny-reference.yaml
  colocated=("runtime.target_devices=[0]" "runtime.drafter_devices=[0,0]" "runtime.colocated=true")
  train tiny-1x1 --config "$cfg"
  train tiny-1x2 --config "$cfg" "${colocated[@]}"
  train tiny-1x2-600 --config "$cfg" "${colocated[@]}" training.max_steps=600
fi

if want q8b; then
  model=/tmp/qwen3-8b-random
  if [[ ! -f "$model/model.safetensors.index.json" ]]; then
    python3 tools/make_random_qwen3.py "$model" --tokenizer "$bin/qwen3-tokenizer" \
      > "$out/make_random_qwen3.log" 2>&1 || { echo "q8b: model generation failed" >> "$summary"; }
  fi
  cat > "$runs/q8b.yaml" <<YAML
model:
  target: $model
  drafter_layers: 5
  mask_token_id: 151669
data:
  train_file: $PWD/assets/data/train.jsonl.xz
  template: chatml
  max_length: 2048
  token_budget: 8192
  rows_per_step: 1
training:
  max_steps: 40
  lr: 6.0e-4
  num_anchors: 512
  block_size: 16
  seed: 0
  log_interval: 5
  save_interval: 0
runtime:
  backend: cuda
  target_devices: [0]
  drafter_devices: [0]
  colocated: true
YAML
  train q8b-1x1 --config "$runs/q8b.yaml"
fi
cat "$summary"
