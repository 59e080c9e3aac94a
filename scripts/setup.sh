#!/usr/bin/env bash
# Installs the Debian 12 packages dflash.cpp needs, then (with CUDA) the CUTLASS/CuTe headers.
# Idempotent and non-interactive: packages already present are left alone, `apt-get update` runs
# at most once, and the headers are fetched only when missing.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build pkg-config git xz-utils
  nlohmann-json3-dev   # JSON: config.json, safetensors headers, tokenizer.json, JSONL
  libyaml-cpp-dev      # YAML: run configs
  libcli11-dev         # CLI parsing
  libspdlog-dev libfmt-dev  # logging and formatting
  libpcre2-dev         # regex with \p{..} and JIT for pre-tokenizers
  libutf8proc-dev      # Unicode normalisation (NFC)
  libopenblas-dev      # BLAS for the CPU reference backend
  liblzma-dev libzstd-dev   # .jsonl.xz / .jsonl.zst input
  libxxhash-dev        # XXH3 digests in checkpoint markers (header-only use)
  libopenmpi-dev openmpi-bin  # MPI: `mpirun -np N dflash train` across nodes (and its tests)
  libgtest-dev libgmock-dev libbenchmark-dev  # tests and benchmarks
  python3 python3-venv # reference/differential tests only (never at run time)
  clang libclang-rt-14-dev  # fuzz harnesses: clang with libFuzzer and its sanitizers (tests only)
)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PKGS[@]} packages present"
else
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# CUTLASS/CuTe headers for the CUDA kernels (only when nvcc exists, as the CUDA build): Debian has
# no package, so take the include folder of the pinned nvidia-cutlass wheel from PyPI (hash
# checked) into .deps/ (ignored by git; CMake's DFLASH_CUTLASS_DIR points there).
CUTLASS_VERSION=4.2.0.0
CUTLASS_SHA256=f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST="$ROOT/.deps/cutlass-$CUTLASS_VERSION"
if { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } &&
   [ ! -f "$DEST/include/cute/arch/mma_sm80.hpp" ]; then
  echo "setup: CUTLASS $CUTLASS_VERSION headers into $DEST"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m venv "$tmp/venv"  # Debian's python3 has no pip of its own; a venv brings one
  "$tmp/venv/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    "nvidia-cutlass==$CUTLASS_VERSION" -d "$tmp"
  wheel="$tmp/nvidia_cutlass-$CUTLASS_VERSION-py3-none-any.whl"
  echo "$CUTLASS_SHA256  $wheel" | sha256sum -c --quiet -
  python3 - "$wheel" "$DEST.part" <<'PY'
import sys, zipfile
prefix = "cutlass_library/source/include/"
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            z.extract(name, sys.argv[2])
PY
  mkdir -p "$DEST"
  rm -rf "$DEST/include"
  mv "$DEST.part/cutlass_library/source/include" "$DEST/include"
  rm -rf "$DEST.part"
fi

# cudnn-frontend headers for the cuDNN causal prefill (src/backend/cuda/attention_cudnn.cpp; the
# cuDNN library itself comes with the CUDA installation): Debian has no package, so take the
# include folder of the pinned nvidia-cudnn-frontend wheel from PyPI (hash checked; the headers
# are the same in every platform's wheel, the x86-64 one is named) into .deps/ (ignored by git;
# CMake's DFLASH_CUDNN_FRONTEND_DIR points there).
CUDNN_FE_VERSION=1.16.0
CUDNN_FE_WHEEL=nvidia_cudnn_frontend-$CUDNN_FE_VERSION-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
CUDNN_FE_SHA256=5c4a8fc573d85a86e08b15d9bf37f729e2487298781867a492a59cde6ac295e2
DEST="$ROOT/.deps/cudnn-frontend-$CUDNN_FE_VERSION"
if { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } &&
   [ ! -f "$DEST/include/cudnn_frontend.h" ]; then
  echo "setup: cudnn-frontend $CUDNN_FE_VERSION headers into $DEST"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m venv "$tmp/venv"
  "$tmp/venv/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --implementation cp --platform manylinux_2_28_x86_64 \
    "nvidia-cudnn-frontend==$CUDNN_FE_VERSION" -d "$tmp"
  echo "$CUDNN_FE_SHA256  $tmp/$CUDNN_FE_WHEEL" | sha256sum -c --quiet -
  python3 - "$tmp/$CUDNN_FE_WHEEL" "$DEST.part" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.startswith("include/") and not name.endswith("/"):
            z.extract(name, sys.argv[2])
PY
  mkdir -p "$DEST"
  rm -rf "$DEST/include"
  mv "$DEST.part/include" "$DEST/include"
  rm -rf "$DEST.part"
fi
