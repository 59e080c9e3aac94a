#!/bin/bash
# D-PACE on the GPU machine (issue 20, first objective): the CUDA D-PACE tests, then the tiny
# reference run (configs/tiny-reference.yaml: same data, steps and seed) with training.loss_type
# dflash and dpace, each followed by `dflash eval` on the mixed 150 prompts.
#
#   bash tools/dpace_device_run.sh --stage DIR   here: build dflash and train_step_cuda_test
#                                                (Release, sm_90a; BUILD_DIR default build, JOBS
#                                                default 2) and copy into DIR (an ignored folder,
#                                                e.g. .dev/dpace) the stripped binaries
#                                                (bin.tar.xz) and the libraries they link that the
#                                                GPU machine lacks (libs.tar.xz)
#   bash tools/dpace_device_run.sh DIR [PART...] on the GPU machine, from the repository root, with
#                                                DIR carried: PART is tests, train, eval, tiny
#                                                (train and eval) or all (default);
#                                                summary.txt and logs.tar.xz (every log, metrics,
#                                                eval report) under $OUT
#
# What to read in $OUT/summary.txt: "train_step_cuda_test rc=0 ... [ PASSED ]" (DrafterCuda.*
# and LossWeightsCuda.*: the device step against the CPU step for dflash and the three D-PACE
# variants); then per loss type one line "LOSS: rc 0, wall S s, step 1200, loss L, simulated tau
# T" from metrics.jsonl and the eval's "tau over steps / mean over prompts" overall and per source
# (math, wordnet, moby, sotu), with "lossless 150/150". EVAL_ARGS overrides the eval's prompt
# selection (default: --limit 150 --per-source 66 --max-new-tokens 96, as in docs/perf.md); STEPS
# overrides training.max_steps (default: the config's 1200).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--stage" ]]; then
  set -e
  dir=${2:?usage: dpace_device_run.sh --stage DIR}
  build=${BUILD_DIR:-build}
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA=ON \
        -DDFLASH_CUDA_ARCHS=90a > /dev/null
  cmake --build "$build" -j"${JOBS:-2}" --target dflash train_step_cuda_test
  mkdir -p "$dir"
  stage=$(mktemp -d)
  strip -o "$stage/dflash" "$build/dflash"
  strip -o "$stage/train_step_cuda_test" "$build/tests/train_step_cuda_test"
  tar -C "$stage" -cJf "$dir/bin.tar.xz" .
  libs=$(ldd "$stage"/* | awk '/=> \// {print $3}' | sort -u |
         grep -vE '/libc\.so|/libm\.so|/libstdc\+\+|/libgcc_s|/ld-linux|/libpthread|/libdl\.|/librt\.|cuda|/libnccl|/libcublas|/libcudnn')
  # shellcheck disable=SC2086
  tar -chJf "$dir/libs.tar.xz" --transform 's|.*/||' $libs
  rm -rf "$stage"
  du -sh "$dir"/*
  echo "staged in $dir: on the GPU machine run 'bash tools/dpace_device_run.sh $dir'"
  exit 0
fi

dir=$(cd "${1:?usage: dpace_device_run.sh DIR [tests|train|eval|tiny|all]...}" && pwd)
shift
parts=("${@:-all}")
out=${OUT:?set OUT to the folder for the logs}
summary="$out/summary.txt"
work=$(mktemp -d)
mkdir -p "$work/bin" "$work/libs" "$work/runs"
tar -C "$work/bin" -xJf "$dir/bin.tar.xz"
tar -C "$work/libs" -xJf "$dir/libs.tar.xz"
export LD_LIBRARY_PATH=$work/libs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
B=$work/bin
missing=$(ldd "$B"/* | awk '/not found/ {print $1}' | sort -u)
if [[ -n "$missing" ]]; then
  echo "libraries not found on this machine: $missing" | tee -a "$summary"
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$summary"
want() {
  local p
  for p in "${parts[@]}"; do
    [[ "$p" == all || "$p" == "$1" || ("$p" == tiny && "$1" != tests) ]] && return 0
  done
  return 1
}

if want tests; then
  export DFLASH_TEST_SOURCE_DIR=$PWD DFLASH_TEST_BINARY=$B/dflash
  s=$(date +%s)
  timeout "${TEST_TIMEOUT:-120}" "$B/train_step_cuda_test" --gtest_color=no \
    --gtest_filter='DrafterCuda.*:LossWeightsCuda.*' > "$out/train_step_cuda_test.log" 2>&1
  rc=$?
  echo "train_step_cuda_test rc=$rc $(($(date +%s) - s)) s $(grep -E \
    '^\[  (PASSED|SKIPPED|FAILED)  \]' "$out/train_step_cuda_test.log" | tr '\n' ' ')" >> "$summary"
  grep -E '^\[  FAILED  \]|Failure$|Expected|Which is|Value of|Actual|loss sum|loss_type' \
    "$out/train_step_cuda_test.log" | head -24 >> "$summary"
fi

# train_tiny LOSS: the tiny reference with training.loss_type=LOSS into $work/runs/LOSS.
train_tiny() {
  local loss=$1 run=$work/runs/$1 s
  s=$(date +%s)
  timeout "${TRAIN_TIMEOUT:-150}" "$B/dflash" train --config configs/tiny-reference.yaml \
    "training.loss_type=$loss" "output_dir=$run" ${STEPS:+"training.max_steps=$STEPS"} \
    > "$out/train-$loss.log" 2>&1
  local rc=$?
  mkdir -p "$out/$loss"
  cp "$run"/{log.txt,metrics.jsonl,config.resolved.yaml} "$out/$loss/" 2>/dev/null
  python3 - "$loss" "$rc" "$(($(date +%s) - s))" "$run/metrics.jsonl" >> "$summary" <<'PY'
import json, sys
loss, rc, wall, path = sys.argv[1:5]
try:
    recs = [json.loads(l) for l in open(path)]
except OSError:
    recs = []
line = f"{loss}: rc {rc}, wall {wall} s"
if recs:
    f, r = recs[0], recs[-1]
    line += (f", step {f.get('step')}: loss {f.get('loss')}, simulated tau {f.get('tau')}"
             f"; step {r.get('step')}: loss {r.get('loss')}, simulated tau {r.get('tau')}"
             f", s_per_step {r.get('s_per_step')}")
print(line)
PY
  grep -hE "loss: |CUDA graphs" "$run/log.txt" 2>/dev/null | head -2 | sed 's/^/  /' >> "$summary"
  [[ $rc == 0 ]] || tail -3 "$out/train-$loss.log" >> "$summary"
}

# eval_tiny LOSS: `dflash eval` of the last checkpoint of train_tiny LOSS.
eval_tiny() {
  local loss=$1 ckpt s
  ckpt=$(ls -d "$work/runs/$loss"/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1)
  [[ -n "$ckpt" ]] || { echo "$loss eval: no checkpoint" >> "$summary"; return; }
  s=$(date +%s)
  # shellcheck disable=SC2086
  timeout "${EVAL_TIMEOUT:-300}" "$B/dflash" eval --target assets/tiny-qwen3 --drafter "$ckpt" \
    --prompts assets/data/eval_prompts.jsonl ${EVAL_ARGS:---limit 150 --per-source 66 \
    --max-new-tokens 96} --output "$out/$loss/eval.json" > "$out/eval-$loss.log" 2>&1
  echo "$loss eval rc=$? $(($(date +%s) - s)) s" >> "$summary"
  python3 - "$out/$loss/eval.json" >> "$summary" <<'PY'
import json, sys
try:
    rep = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print(f"  no eval report: {e}")
    sys.exit(0)
t, prompts = rep["total"], rep.get("prompts", [])
lossless = sum(1 for p in prompts if p.get("lossless"))
print(f"  all: tau {t['tau']:.3f} / {t['tau_prompt_mean']:.3f} (over steps / mean over prompts), "
      f"{len(prompts)} prompts, lossless {lossless}/{len(prompts)}")
for src, s in rep.get("per_source", {}).items():
    print(f"  {src}: tau {s['tau']:.3f} / {s['tau_prompt_mean']:.3f}")
PY
}

# Both trainings first: their figures come back even if an eval runs long.
if want train; then
  train_tiny dflash
  train_tiny dpace
fi
if want eval; then
  eval_tiny dflash
  eval_tiny dpace
fi
rm -rf "$work"
# The device tool brings back at most 8 files: everything but the summary goes into logs.tar.xz.
(cd "$out" && tar -cJf "$work.tar.xz" --exclude=summary.txt . &&
  find . -mindepth 1 ! -name summary.txt -delete && mv "$work.tar.xz" logs.tar.xz)
cat "$summary"
