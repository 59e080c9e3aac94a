#!/usr/bin/env bash
# dflash.cpp — refuses an upward #include between the layers of src/ (CMakeLists.txt, "the
# libraries, one per layer"): core ← ops (ops, backend) ← data ← model ← train ← infer ← cli.
# A file may include its own layer and the layers below; anything else is printed as
# FILE:LINE: <layer> includes <higher layer> (<header>) and the test fails. Link-level cycles are
# caught by the dflash_layer_check_<layer> executables; this catches header-only ones too. It
# also refuses an #include of backend/cuda/gemm.hpp from model/ or infer/ (they call the GEMM
# through ops/gemm.hpp).
# Usage: layering_test.sh SOURCE_DIR
set -euo pipefail
src="${1:?usage: layering_test.sh SOURCE_DIR}/src"
[[ -d "$src" ]] || { echo "layering_test.sh: no folder $src" >&2; exit 2; }

rank_of() {  # the layer rank of a top folder of src/ (empty when it is not a layer)
  case "$1" in
    core) echo 0 ;;
    ops | backend) echo 1 ;;
    data) echo 2 ;;
    model) echo 3 ;;
    train) echo 4 ;;
    infer) echo 5 ;;
    cli) echo 6 ;;
  esac
}

bad=0
checked=0
while IFS= read -r -d '' file; do
  rel="${file#"$src"/}"
  own="${rel%%/*}"
  own_rank="$(rank_of "$own")"
  if [[ -z "$own_rank" ]]; then
    echo "$file: src/$own is not a layer (add it to layering_test.sh and CMakeLists.txt)"
    bad=1
    continue
  fi
  while IFS=: read -r line header; do
    dir="${header%%/*}"
    rank="$(rank_of "$dir")"
    [[ -n "$rank" ]] || continue  # a third-party or same-folder header
    checked=$((checked + 1))
    if ((rank > own_rank)); then
      echo "src/$rel:$line: $own includes $dir ($header)"
      bad=1
    fi
  done < <(grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$file" |
           sed -E 's/^([0-9]+):[^"]*"([^"]+)".*/\1:\2/')
done < <(find "$src" -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' \) \
           -print0)

# Model and inference code multiply through the ops contract (ops/gemm.hpp, gemm_bf16_cuda),
# never through the backend's cuBLASLt wrapper (issue 13's layout rule).
while IFS=: read -r file line _; do
  rel="${file#"$src"/}"
  echo "src/$rel:$line: includes backend/cuda/gemm.hpp (call gemm_bf16_cuda of ops/gemm.hpp)"
  bad=1
done < <(grep -rn '^[[:space:]]*#[[:space:]]*include[[:space:]]*"backend/cuda/gemm\.hpp"' \
           "$src/model" "$src/infer" || true)

if ((checked == 0)); then
  echo "layering_test.sh: no project #include found under $src" >&2
  exit 1
fi
if ((bad)); then
  echo "layering_test.sh: upward includes or direct GEMM calls above (a layer may include itself" \
       "and the layers below; model/ and infer/ multiply through ops/gemm.hpp)"
  exit 1
fi
echo "layering_test.sh: $checked project includes, none upward"
