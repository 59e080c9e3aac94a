#!/bin/bash
# Builds the CUDA op tests (tests/cuda/*_test.cpp, one GoogleTest binary each) and runs them on the
# GPU of this machine; every test compares a CUDA op with its CPU reference and skips itself when no
# GPU is visible. Exit code 0 = all passed.
#   bash scripts/cuda_tests.sh               build (CUDA on, static deps) and run here
#   bash scripts/cuda_tests.sh --stage DIR   build, then copy the stripped binaries, the OpenBLAS
#                                            libraries the CPU references need and DIR/run.sh into
#                                            DIR, for a GPU machine without build tools: there run
#                                            `bash DIR/run.sh` (writes a summary, exit 0 = pass)
# Environment: BUILD_DIR (default build-cuda), JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-cuda}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA=ON \
      -DDFLASH_STATIC_DEPS=ON -DDFLASH_BUILD_BENCH=OFF > /dev/null
targets=$(cd tests/cuda && ls *_test.cpp | sed 's/\.cpp$//')
# shellcheck disable=SC2086
cmake --build "$build" -j"${JOBS:-2}" --target $targets

if [[ "${1:-}" == "--stage" ]]; then
  dir=${2:?usage: cuda_tests.sh --stage DIR}
  mkdir -p "$dir"
  for t in $targets; do strip -o "$dir/$t" "$build/tests/$t"; done
  blas=$(ldd "$build/tests/linear_cuda_test" | awk '/libopenblas|libgfortran|libquadmath/ {print $3}')
  tar -chJf "$dir/libs.tar.xz" --transform 's|.*/||' $blas
  cat > "$dir/run.sh" <<'RUN'
#!/bin/bash
# Runs every *_cuda_test binary beside this script; prints one line per binary and a summary.
cd "$(dirname "$0")"
mkdir -p /tmp/dflash_libs && tar -C /tmp/dflash_libs -xJf libs.tar.xz
export LD_LIBRARY_PATH=/tmp/dflash_libs:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fails=""
for t in ./*_test; do
  echo "=== $t"
  start=$(date +%s%N)
  if ! $t --gtest_color=no; then fails="$fails $t"; fi
  echo "--- $t wall $(( ($(date +%s%N) - start) / 1000000 )) ms"
done
echo "FAILED:${fails:- none}"
[[ -z "$fails" ]]
RUN
  chmod +x "$dir/run.sh"
  echo "staged in $dir: run 'bash $dir/run.sh' on the GPU machine"
  exit 0
fi

fails=""
for t in $targets; do "$build/tests/$t" --gtest_color=no || fails="$fails $t"; done
echo "FAILED:${fails:- none}"
[[ -z "$fails" ]]
