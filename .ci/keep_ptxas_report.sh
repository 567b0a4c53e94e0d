#!/usr/bin/env bash
# CI's CMAKE_CUDA_COMPILER_LAUNCHER: runs the build's nvcc command with ptxas's
# report turned on and keeps the compiler's messages for each cpp/cuda source
# in $FUSEDATTN_PTXAS_REPORTS, so that the compile gate
# (.ci/check_cuda_compiles.sh --reports DIR) checks the build's own compilation
# instead of compiling every kernel a second time.
set -uo pipefail
src=
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [ "${args[i]}" = -c ] && src=${args[i + 1]:-}
done
case "$src" in
  */cpp/cuda/*.cu | cpp/cuda/*.cu) [ -n "${FUSEDATTN_PTXAS_REPORTS:-}" ] || exec "$@" ;;
  *) exec "$@" ;;
esac
mkdir -p "$FUSEDATTN_PTXAS_REPORTS"
log="$FUSEDATTN_PTXAS_REPORTS/$(echo "cpp/cuda/${src##*cpp/cuda/}" | tr / _).log"
"$@" -Xptxas -v 2> "$log"
rc=$?
cat "$log" >&2
exit $rc
