#!/usr/bin/env bash
# Installs the Debian 12 packages dflash.cpp needs. Idempotent and non-interactive:
# packages already present are left alone, and `apt-get update` runs at most once.
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
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
