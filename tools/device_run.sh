#!/bin/bash
# Runs on the GPU machine what was built here: one stager and the runs of every issue as parts.
# The GPU machine's Ubuntu lacks utf8proc, another yaml-cpp/spdlog, Open MPI..., so the binaries
# travel with the shared libraries they link: all but glibc's, the compiler runtime's, the CUDA
# toolkit's, and the compression, udev and PCRE2 libraries that Ubuntu has in newer compatible
# versions (a carried older libz would be loaded by the machine's Python too).
#
#   bash tools/device_run.sh --stage DIR [TARGET...]
#       here: build the CMake TARGETs (BUILD_DIR, default build; JOBS, default 2; default targets:
#       dflash, every CUDA test binary (*cuda*_test), decode_cuda_bench and gemm_bench) and put
#       into DIR (an ignored folder, e.g. .dev/mine; carry it in the device call) bin.tar.xz (the
#       stripped binaries), libs.tar.xz (the libraries they link) and the Qwen3 tokenizer (for the
#       q8b parts).
#   bash tools/device_run.sh DIR PART...
#       on the GPU machine, from the repository root (a copy of the checkout: assets, configs and
#       fixtures are read from it); logs under $OUT: summary.txt, the small reports beside it and
#       every other log in logs.tar.xz.
#
# PARTs (each appends to $OUT/summary.txt what to read):
#   tests             every staged *cuda*_test (TESTS="a_cuda_test b" narrows, GTEST_FILTER filters,
#                     TEST_TIMEOUT s each, default 150): "NAME rc=0 N s [ PASSED ] ..." per binary,
#                     then the failure lines; the NCCL two-GPU test skips on one GPU
#   memcheck:NAME     compute-sanitizer --tool memcheck on test binary NAME (GTEST_FILTER filters):
#                     its "ERROR SUMMARY" line
#   bench[:ARGS]      `dflash bench --preset qwen3-8b ARGS` (ARGS: comma-separated options, e.g.
#                     bench:--recompute,always or bench:--loss-type,dpace): the phase table, the
#                     step, plan vs measured memory, the kernel rows
#   decode-bench      decode_cuda_bench: the Qwen3-8B-shaped one-token (BM_TargetStep1), 16-row
#                     verify, drafter-block and speculative steps at batch 1 and 8 with cuBLASLt
#                     projections (the default) and decode_linear_cuda ones (…RowGemm); BM_Gemm and
#                     BM_DecodeLinear weight GB/s; tiny tokens/s at batch 1 and 64
#   attention-bench   attention_bench (stage it): the DFlash attention kernels alone at the reference
#                     batch, every family in one process, D 128 and 64 (forward, backward, % of floor)
#   gemm-bench[:ARGS] gemm_bench ARGS (comma-separated, e.g. gemm-bench:--only=target,--rounds=45):
#                     every cuBLASLt GEMM shape of the reference step (ms, TFLOP/s, the plan's
#                     tile/stages/split-K) and the heuristic's other candidates against it
#   train:NAME[:KEY=V...]
#                     `dflash train --config configs/tiny-reference.yaml KEY=V...` into run NAME:
#                     rc, wall, first/last loss and simulated τ, s_per_step
#   eval:NAME[:ARGS]  `dflash eval` of run NAME's last checkpoint on the mixed eval prompts
#                     (EVAL_ARGS, default --limit 150 --per-source 66 --max-new-tokens 96; ARGS:
#                     comma-separated extra options, e.g. eval:dflash:--backend,cuda,--batch-size,64):
#                     τ overall and per source, lossless count
#   cpu-decode        train the tiny reference on the GPU, then `dflash eval` on the CPU backend at
#                     batch 1, 8 and 16 (outputs must agree) and `dflash regenerate` of 1,000 corpus
#                     records twice (the same bytes): user/system s, faults, tokens/s, records/s
#   regenerate:TAG[:OPTIONS]
#                     `dflash regenerate` of 1,000 corpus records with the tiny target, T 0.7, seed
#                     1, OPTIONS (comma-separated, e.g. regenerate:cuda64:--backend,cuda,--batch-size,64),
#                     twice: records/s, user/system s, and whether the two outputs are identical
#   pipeline-tiny     the tiny reference by 1 target + 1 drafter worker and 1 + 2 colocated (all
#                     steps and 600 steps): the three simulated τ within 0.1
#   pipeline-q8b      a random Qwen3-8B-shaped target (tools/make_random_qwen3.py), 1 + 1 colocated,
#                     40 steps: target_busy, drafter_busy and s/step per logged step
#   peer              the reference PyTorch trainer's step at the same shapes (../shared/tools/
#                     peer_step.py, copied by the stager, with SpecForge's sources: stage with
#                     SPECFORGE_GIT=<a fetched git dir of sgl-project/SpecForge>, which archives its
#                     specforge package and configs/qwen3-8b-dflash.json into DIR/peer.tar.xz): the
#                     RESULT line (target and drafter ms, tokens/s, peak memory). Measure it in the
#                     same call as `bench`: ratios count, absolute times drift between machines.
set -uo pipefail
cd "$(dirname "$0")/.."

stage() {
  set -e
  local dir=$1 build=${BUILD_DIR:-build}
  shift
  local targets=("$@")
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA=ON \
        -DDFLASH_CUDA_ARCHS=90a > /dev/null
  if [[ ${#targets[@]} == 0 ]]; then
    mapfile -t targets < <(ninja -C "$build" -t targets all |
                           grep -oE '^(tests/[a-z0-9_]*cuda[a-z0-9_]*_test|bench/(decode_cuda|gemm)_bench): ' |
                           sed -E 's|^[a-z]+/||; s|: $||')
    targets=(dflash "${targets[@]}")
  fi
  cmake --build "$build" -j"${JOBS:-2}" --target "${targets[@]}"
  local tmp f
  tmp=$(mktemp -d)
  for f in "${targets[@]}"; do
    local path
    path=$(find "$build" -maxdepth 2 -type f -name "$f" -perm -u+x | head -1)
    [[ -n "$path" ]] || { echo "stage: no executable $f under $build" >&2; exit 1; }
    strip -o "$tmp/$f" "$path"
  done
  mkdir -p "$dir"
  tar -C "$tmp" -cJf "$dir/bin.tar.xz" .
  local libs
  libs=$(ldd "$tmp"/* | awk '/=> \// {print $3}' | sort -u |
         grep -vE '/libc\.so|/libm\.so|/libstdc\+\+|/libgcc_s|/ld-linux|/libpthread|/libdl\.|/librt\.|cuda|/libnccl|/libcublas|/libcudnn' |
         grep -vE '/libz\.so|/liblzma\.so|/libzstd\.so|/libudev\.so|/libpcre2-8\.so')
  # shellcheck disable=SC2086
  tar -chJf "$dir/libs.tar.xz" --transform 's|.*/||' $libs
  local tok=${DFLASH_SHARED_DIR:-../shared}/fixtures/qwen3-tokenizer
  mkdir -p "$dir/qwen3-tokenizer"
  cp "$tok/tokenizer.json.xz" "$tok/tokenizer_config.json" "$dir/qwen3-tokenizer/"
  cp "${DFLASH_SHARED_DIR:-../shared}/tools/peer_step.py" "$dir/"
  if [[ -n "${SPECFORGE_GIT:-}" ]]; then
    git --git-dir="$SPECFORGE_GIT" archive --prefix=peer/ HEAD specforge \
      configs/qwen3-8b-dflash.json | xz > "$dir/peer.tar.xz"
  fi
  rm -rf "$tmp"
  du -sh "$dir"/*
  echo "staged in $dir: on the GPU machine run 'bash tools/device_run.sh $dir PART...'"
}

if [[ "${1:-}" == "--stage" ]]; then
  stage "${2:?usage: device_run.sh --stage DIR [TARGET...]}" "${@:3}"
  exit 0
fi

dir=$(cd "${1:?usage: device_run.sh DIR PART...}" && pwd)
shift
[[ $# -gt 0 ]] || { echo "usage: device_run.sh DIR PART..." >&2; exit 2; }
out=${OUT:?set OUT to the folder for the logs}
summary=$out/summary.txt
work=/tmp/device-run
runs=$work/runs
B=$work/bin
START=$(date +%s)
rm -rf "$work" && mkdir -p "$B" "$work/libs" "$runs"
tar -C "$B" -xJf "$dir/bin.tar.xz"
tar -C "$work/libs" -xJf "$dir/libs.tar.xz"
export LD_LIBRARY_PATH=$work/libs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export DFLASH_TEST_SOURCE_DIR=$PWD DFLASH_TEST_BINARY=$B/dflash
missing=$(ldd "$B"/* | awk '/not found/ {print $1}' | sort -u)
if [[ -n "$missing" ]]; then
  echo "libraries not found on this machine: $missing" | tee -a "$summary"
  exit 1
fi
echo "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader); \
$(nproc) cores" >> "$summary"
log() { echo "=== $(date +%T) +$(($(date +%s) - START)) s $*" >> "$summary"; }

# gtest NAME: runs one test binary; its summary line and failure lines.
gtest() {
  local t=$1 s rc
  s=$(date +%s)
  timeout "${TEST_TIMEOUT:-150}" "$B/$t" --gtest_color=no ${GTEST_FILTER:+"--gtest_filter=$GTEST_FILTER"} \
    > "$out/$t.log" 2>&1
  rc=$?
  echo "$t rc=$rc $(($(date +%s) - s)) s $(grep -E '^\[  (PASSED|SKIPPED|FAILED)  \]' \
    "$out/$t.log" | tr '\n' ' ')" >> "$summary"
  grep -E '^\[  FAILED  \]|Failure$|Expected|Which is|Value of|Actual|leaves the CPU' \
    "$out/$t.log" | head -16 >> "$summary"
}

# train NAME ARGS...: `dflash train ARGS output_dir=RUN`; its figures from metrics.jsonl.
train() {
  local name=$1 s rc
  shift
  rm -rf "${runs:?}/$name"
  s=$(date +%s)
  timeout "${TRAIN_TIMEOUT:-300}" "$B/dflash" train "$@" "output_dir=$runs/$name" \
    > "$out/train-$name.log" 2>&1
  rc=$?
  mkdir -p "$out/$name"
  cp "$runs/$name"/{log.txt,metrics.jsonl,status.json,config.resolved.yaml} "$out/$name/" \
    2>/dev/null
  python3 - "$name" "$rc" "$(($(date +%s) - s))" "$runs/$name/metrics.jsonl" >> "$summary" <<'PY'
import json, sys
name, rc, wall, path = sys.argv[1:5]
try:
    recs = [json.loads(l) for l in open(path)]
except OSError:
    recs = []
line = f"{name}: rc {rc}, wall {wall} s"
if recs:
    f, r = recs[0], recs[-1]
    line += (f", step {f.get('step')}: loss {f.get('loss')}, simulated tau {f.get('tau')}"
             f"; step {r.get('step')}: loss {r.get('loss')}, simulated tau {r.get('tau')}"
             f", s_per_step {r.get('s_per_step')}, tokens/s {r.get('tokens_per_s')}")
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
  grep -hE "loss: |CUDA graphs|collective:|bit-identical|failed|stuck|error" \
    "$runs/$name/log.txt" 2>/dev/null | head -6 | sed 's/^/  /' >> "$summary"
  [[ $rc == 0 ]] || tail -3 "$out/train-$name.log" | sed 's/^/  /' >> "$summary"
}

# eval_run NAME ARGS...: `dflash eval` of run NAME's last checkpoint; τ overall and per source.
eval_run() {
  local name=$1 ckpt s tag
  shift
  ckpt=$(ls -d "$runs/$name"/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1)
  [[ -n "$ckpt" ]] || { echo "eval $name: no checkpoint" >> "$summary"; return; }
  tag=$name${1:+-$(echo "$*" | tr -c 'a-z0-9\n' '_' | tr -s _ | sed 's/^_//')}
  s=$(date +%s)
  # shellcheck disable=SC2086
  timeout "${EVAL_TIMEOUT:-300}" "$B/dflash" eval --target assets/tiny-qwen3 --drafter "$ckpt" \
    --prompts assets/data/eval_prompts.jsonl ${EVAL_ARGS:---limit 150 --per-source 66 \
    --max-new-tokens 96} "$@" --output "$out/eval-$tag.json" > "$out/eval-$tag.log" 2>&1
  local rc=$?
  echo "eval $tag rc=$rc $(($(date +%s) - s)) s" >> "$summary"
  [[ $rc == 0 ]] || tail -3 "$out/eval-$tag.log" | sed 's/^/  /' >> "$summary"
  grep -E "tokens/s|speedup" "$out/eval-$tag.log" | head -3 | sed 's/^/  /' >> "$summary"
  python3 - "$out/eval-$tag.json" >> "$summary" <<'PY'
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

# "user U sys S faults F wall W" of a command's /usr/bin/time line.
timed() { /usr/bin/time -f "user %U sys %S faults %R wall %e" "$@"; }

cpu_decode() {
  train tiny-cpu-decode --config configs/tiny-reference.yaml
  local dr b r
  dr=$(ls -d "$runs/tiny-cpu-decode"/checkpoint-* | sort -t- -k2 -n | tail -1)
  for b in 1 8 16; do
    log "cpu eval batch $b"
    timed "$B/dflash" --log-level warn eval --target assets/tiny-qwen3 --drafter "$dr" \
      --prompts assets/data/eval_prompts.jsonl --limit "${PROMPTS:-150}" --per-source 66 \
      --max-new-tokens 96 --batch-size "$b" --output "$out/cpu_eval_b$b.json" \
      > "$out/cpu_eval_b$b.log" 2>&1
    grep -E "^tau:|tokens/s|speedup|lossless|^user" "$out/cpu_eval_b$b.log" >> "$summary"
  done
  python3 - "$out" >> "$summary" <<'PY'
import json, sys
rows = {b: [(p["id"], p["new_tokens"], p["accept_histogram"])
            for p in json.load(open(f"{sys.argv[1]}/cpu_eval_b{b}.json"))["prompts"]]
        for b in (1, 8, 16)}
print("eval outputs equal across batch sizes:", rows[1] == rows[8] == rows[16])
PY
  regenerate_twice cpu --batch-size 16
}

# regenerate_twice TAG OPTIONS...: `dflash regenerate` of the corpus's first 1,000 records with the
# tiny target (T 0.7, seed 1, OPTIONS), twice: records/s of each run and whether the bytes agree.
regenerate_twice() {
  local tag=$1 r
  shift
  xz -dc assets/data/train.jsonl.xz | head -1000 > "$work/in1000.jsonl"
  for r in 1 2; do
    log "regenerate 1,000 records ($tag $*), run $r"
    rm -f "$work/regen-$tag-$r.jsonl"
    timed "$B/dflash" --log-level warn regenerate --target assets/tiny-qwen3 \
      --data "$work/in1000.jsonl" --out "$work/regen-$tag-$r.jsonl" --temperature 0.7 --seed 1 \
      "$@" > "$out/regen-$tag-$r.log" 2>&1
    grep -E "written|records/s|tokens/s|^user|rror" "$out/regen-$tag-$r.log" >> "$summary"
  done
  if cmp -s "$work/regen-$tag-1.jsonl" "$work/regen-$tag-2.jsonl"; then
    echo "regenerate ($tag) reruns identical" >> "$summary"
  else
    echo "regenerate ($tag) reruns DIFFER" >> "$summary"
  fi
}

pipeline_q8b() {
  local model=$work/qwen3-8b-random
  python3 tools/make_random_qwen3.py "$model" --tokenizer "$dir/qwen3-tokenizer" \
    > "$out/make_random_qwen3.log" 2>&1 || { echo "q8b: model generation failed" >> "$summary"; }
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
}

# Splits "a,b,c" into the array `split`.
split_args() { IFS=, read -r -a split <<< "$1"; }

for part in "$@"; do
  log "$part"
  case $part in
    tests)
      for t in ${TESTS:-$(cd "$B" && ls -- *cuda*_test)}; do gtest "$t"; done ;;
    memcheck:*)
      t=${part#memcheck:}
      timeout "${TEST_TIMEOUT:-300}" compute-sanitizer --tool memcheck "$B/$t" --gtest_color=no \
        ${GTEST_FILTER:+"--gtest_filter=$GTEST_FILTER"} > "$out/memcheck-$t.log" 2>&1
      echo "memcheck $t rc=$?: $(grep -E 'ERROR SUMMARY' "$out/memcheck-$t.log" | tail -1)" \
        >> "$summary" ;;
    bench | bench:*)
      split=()
      [[ $part == bench:* ]] && split_args "${part#bench:}"
      tag=$(echo "${part#bench}" | tr -c 'a-z0-9\n' '_' | tr -s _)
      timeout 200 "$B/dflash" bench --preset qwen3-8b "${split[@]}" --json "$out/bench$tag.json" \
        > "$out/bench$tag.txt" 2>&1
      echo "bench${split[*]:+ ${split[*]}} rc=$?" >> "$summary"
      tail -30 "$out/bench$tag.txt" >> "$summary" ;;
    decode-bench)
      timeout 300 "$B/decode_cuda_bench" --benchmark_counters_tabular=true > "$out/decode_bench.log" 2>&1
      echo "decode bench rc=$?" >> "$summary"
      grep -E "^BM_" "$out/decode_bench.log" >> "$summary" ;;
    attention-bench)
      for d in 128 64; do
        timeout 60 "$B/attention_bench" --head-dim "$d" >> "$out/attention_bench.txt" 2>&1
        echo "attention bench D $d rc=$?" >> "$summary"
      done
      cat "$out/attention_bench.txt" >> "$summary" ;;
    gemm-bench|gemm-bench:*)
      split=()
      [[ $part == *:* ]] && split_args "${part#gemm-bench:}"
      timeout 120 "$B/gemm_bench" "${split[@]}" > "$out/gemm_bench.txt" 2>&1
      echo "gemm bench rc=$?" >> "$summary"
      cat "$out/gemm_bench.txt" >> "$summary" ;;
    train:*)
      rest=${part#train:}
      IFS=: read -r -a kv <<< "$rest"
      train "${kv[0]}" --config configs/tiny-reference.yaml "${kv[@]:1}" ;;
    eval:*)
      rest=${part#eval:}
      split=()
      [[ $rest == *:* ]] && split_args "${rest#*:}"
      eval_run "${rest%%:*}" "${split[@]}" ;;
    cpu-decode) cpu_decode ;;
    regenerate:*)
      rest=${part#regenerate:}
      split=()
      [[ $rest == *:* ]] && split_args "${rest#*:}"
      regenerate_twice "${rest%%:*}" "${split[@]}" ;;
    pipeline-tiny)
      colocated=("runtime.target_devices=[0]" "runtime.drafter_devices=[0,0]" "runtime.colocated=true")
      train tiny-1x1 --config configs/tiny-reference.yaml
      train tiny-1x2 --config configs/tiny-reference.yaml "${colocated[@]}"
      train tiny-1x2-600 --config configs/tiny-reference.yaml "${colocated[@]}" training.max_steps=600 ;;
    pipeline-q8b) pipeline_q8b ;;
    peer)
      [[ -f "$dir/peer.tar.xz" ]] || { echo "peer: no $dir/peer.tar.xz (stage with SPECFORGE_GIT)" \
        >> "$summary"; continue; }
      mkdir -p "$work/peer" && tar -C "$work/peer" -xJf "$dir/peer.tar.xz"
      PYTHONUNBUFFERED=1 timeout 300 python3 "$dir/peer_step.py" --specforge "$work/peer/peer" \
        --drafter-config "$work/peer/peer/configs/qwen3-8b-dflash.json" > "$out/peer.log" 2>&1
      echo "peer rc=$?" >> "$summary"
      grep -E "RESULT|Error" "$out/peer.log" | tail -3 >> "$summary" ;;
    *) echo "unknown part '$part'" >> "$summary" ;;
  esac
done
log "done"
# The device tool brings back a limited number of files: the summary and the top-level JSON reports
# stay, everything (them included) is also in logs.tar.xz.
(cd "$out" && tar -cJf "$work/logs.tar.xz" --exclude=./summary.txt . &&
  find . -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name '*.json' -exec rm -rf {} + &&
  mv "$work/logs.tar.xz" .)
cat "$summary"
