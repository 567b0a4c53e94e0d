#!/usr/bin/env bash
# Compiles every CUDA kernel source with nvcc for sm_80 and sm_90a, so a CUDA
# build break fails CI even on a machine without a GPU or a CUDA build of
# PyTorch. Kernels include no ATen header (docs/architecture.md), which is what
# makes this possible. Also builds and runs tests/native (host-side checks of
# kernel helpers). Usage: .ci/check_cuda_compiles.sh [--reports DIR] [build-dir]
# --reports DIR: a source whose report a build kept there
# (.ci/keep_ptxas_report.sh) is checked from it, not compiled again, where that
# build compiled it as this script would (both targets, no language
# extensions); its headers must then include none of PyTorch's, which a plain
# compile here checks by having no PyTorch on the include path.
set -euo pipefail
reports=
if [ "${1:-}" = --reports ]; then
  reports=$(realpath -m "$2")
  shift 2
fi
cd "$(dirname "$0")/.."

if ! command -v nvcc >/dev/null 2>&1; then
  echo "check_cuda_compiles: nvcc not on PATH, skipping the CUDA compile check"
  exit 0
fi
out=${1:-build/nvcc-check}
mkdir -p "$out"
mapfile -t sources < <(find cpp/cuda -name '*.cu' | sort)
echo "check_cuda_compiles: $(nvcc --version | tail -1); ${#sources[@]} source(s)"
# Whether report $1 exists and its build compiled the source as this script
# does: for sm_80 and sm_90a, without nvcc's relaxed-constexpr and lambda
# extensions (which turn some of the errors below into nothing), headers listed.
report_usable() {
  [ -n "$reports" ] && [ -f "$1" ] && grep -q "^depends on:" "$1" || return 1
  local command
  command=$(head -1 "$1")
  [[ $command == "command: "* && $command == *"arch=compute_80,code=sm_80"* \
     && $command == *"arch=compute_90a,code=sm_90a"* && $command != *--expt-* ]]
}

reused=0
for src in "${sources[@]}"; do
  name=$(echo "$src" | tr '/' '_')
  log="$out/$name.o.ptxas.log"
  if report_usable "$reports/$name.log"; then
    log="$reports/$name.log"
    reused=$((reused + 1))
    # The kernels include no PyTorch header (docs/architecture.md).
    torch_headers=$(sed -n '/^depends on:/,$p' "$log" | grep -oE "[^ ]*(/torch/include/|/ATen/|/c10/)[^ ]*" || true)
    if [ -n "$torch_headers" ]; then
      echo "$torch_headers" | head -3
      echo "check_cuda_compiles: $src includes a PyTorch header; kernels include none"
      exit 1
    fi
  else
    nvcc --threads 2 -std=c++17 -O3 --use_fast_math -Icpp/include \
      -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a \
      -Xptxas -v -c "$src" -o "$out/$name.o" 2> "$log" || { cat "$log"; exit 1; }
  fi
  # Spills are a performance bug on the GPU: reported here, to be fixed.
  { grep -E "spill stores|Used [0-9]+ registers" "$log" || true; } | sed "s|^|  $src: |" | sort -u | head -20
  if grep -qE "[1-9][0-9]* bytes spill stores" "$log"; then
    echo "check_cuda_compiles: WARNING: $src spills registers (see $log)"
  fi
  # A host function called from device code compiles with a warning and
  # computes garbage on the GPU (a window's band once read one): an error here.
  if grep -qE "warning #2001[1345]-D" "$log"; then
    grep -E "warning #2001[1345]-D" "$log" | sort -u
    echo "check_cuda_compiles: $src: a host function called from device code"
    exit 1
  fi
  # ptxas C7510-C7519: wgmma serialised (C7514: a non-wgmma instruction
  # touches an accumulator inside a pipeline stage; others: a call, too few
  # registers, an ill-formed stage). Such code compiles and runs right but
  # slower (an idle-warpgroup branch in the sm90 forward once cost 22-27%, see
  # docs/cuda-notes.md), and only a GPU run would show it. So it fails the check.
  if grep -qE "C751[0-9]|wgmma.mma_async instructions are serialized" "$log"; then
    grep -E "C751[0-9]|wgmma.mma_async instructions are serialized" "$log"
    echo "check_cuda_compiles: $src: wgmma serialised (ptxas C751x)"
    exit 1
  fi
done
[ -z "$reports" ] || echo "check_cuda_compiles: $reused of ${#sources[@]} source(s) checked from the build's reports in $reports"

# lab/cuda: standalone kernel drivers (no PyTorch), built and linked so they keep up with the kernels.
nvcc -std=c++17 -O3 --use_fast_math -Icpp/include -gencode=arch=compute_90a,code=sm_90a \
  lab/cuda/decode_splits.cu -o "$out/decode_splits"
echo "  lab/cuda/decode_splits.cu: built"
nvcc -std=c++17 -O3 -Icpp/include -gencode=arch=compute_90a,code=sm_90a \
  lab/cuda/stream_roofline.cu cpp/cuda/hopper/tensor_maps.cu -o "$out/stream_roofline"
echo "  lab/cuda/stream_roofline.cu: built"
nvcc -std=c++17 -O3 -Icpp/include -gencode=arch=compute_90a,code=sm_90a \
  lab/cuda/stream_schedule.cu -o "$out/stream_schedule"
echo "  lab/cuda/stream_schedule.cu: built"

# tests/native: host-side checks of kernel helpers (no GPU needed), built and run.
for test in tests/native/*.cu; do
  nvcc -std=c++17 -O1 -Icpp/include "$test" -o "$out/$(basename "$test" .cu)"
  "$out/$(basename "$test" .cu)"
done

# The CUDA operator layer (cpp/ops/*_cuda*.cpp) is C++ against PyTorch's CUDA
# headers; it is built only with a CUDA torch. With any torch installed,
# check its syntax against those headers. A CPU wheel lacks the one generated
# header, c10/cuda/impl/cuda_cmake_macros.h (build options, none of which these
# files use): an empty stand-in takes its place.
torch_include=$(python3 -c "import torch.utils.cpp_extension as e; print(' '.join(e.include_paths()))" 2>/dev/null || true)
if [ -n "$torch_include" ]; then
  stub="$out/stub-include"
  mkdir -p "$stub/c10/cuda/impl"
  : > "$stub/c10/cuda/impl/cuda_cmake_macros.h"
  # nvcc may be a wrapper script: ask it where its headers are.
  cuda_include=$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/.*INCLUDES="-I\([^"]*\)".*/\1/p' | head -1)
  for src in cpp/ops/*_cuda*.cpp; do
    echo "  $src: syntax against torch's CUDA headers"
    g++ -std=c++20 -fsyntax-only -DFUSEDATTN_WITH_CUDA -Icpp/include -I"$stub" \
      $(printf -- '-I%s ' $torch_include) -I"$cuda_include" "$src"
  done
else
  echo "check_cuda_compiles: torch not importable, skipping the CUDA operator layer"
fi
echo "check_cuda_compiles: ok"
