#!/usr/bin/env bash
# Runs a command as on a machine with no CUDA toolkit: in a private mount
# namespace, empty file systems hide the toolkit's folder (where
# /usr/local/cuda points) and /usr/local/bin (where this machine keeps its
# nvcc, ptxas... wrapper scripts), and CUDA_HOME/CUDA_PATH/CUDACXX are unset.
# Nothing changes outside the command. Needs root (unshare -m).
# Usage: .ci/without_cuda_toolkit.sh COMMAND [ARG...]
set -euo pipefail
hide=$(for dir in /usr/local/cuda /usr/local/cuda-* /usr/local/bin; do
  [ -d "$dir" ] && readlink -f "$dir"; done | sort -u | tr '\n' ' ')
FUSEDATTN_HIDE=$hide exec unshare -m bash -c '
  set -e
  for dir in $FUSEDATTN_HIDE; do mount -t tmpfs none "$dir"; done
  unset CUDA_HOME CUDA_PATH CUDACXX CUDA_TOOLKIT_ROOT FUSEDATTN_HIDE
  if command -v nvcc >/dev/null 2>&1; then
    echo "without_cuda_toolkit: nvcc still found at $(command -v nvcc)" >&2; exit 1
  fi
  exec "$@"' bash "$@"
