#!/usr/bin/env bash
# CI's CMAKE_CUDA_COMPILER_LAUNCHER: runs the build's nvcc command with ptxas's
# report turned on and keeps, for each cpp/cuda source, a report in
# $FUSEDATTN_PTXAS_REPORTS: the command line, the compiler's messages and the
# headers it read (its depfile). The compile gate (.ci/check_cuda_compiles.sh
# --reports DIR) checks those instead of compiling every kernel a second time.
set -uo pipefail
src= depfile=
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    -c) src=${args[i + 1]:-} ;;
    -MF) depfile=${args[i + 1]:-} ;;
  esac
done
case "$src" in
  */cpp/cuda/*.cu | cpp/cuda/*.cu) [ -n "${FUSEDATTN_PTXAS_REPORTS:-}" ] || exec "$@" ;;
  *) exec "$@" ;;
esac
mkdir -p "$FUSEDATTN_PTXAS_REPORTS"
report="$FUSEDATTN_PTXAS_REPORTS/$(echo "cpp/cuda/${src##*cpp/cuda/}" | tr / _).log"
messages=$(mktemp)
"$@" -Xptxas -v 2> "$messages"
rc=$?
# The build's log gets the messages but ptxas's report (kept in the report).
grep -vE "^ptxas info|^    [0-9]+ bytes stack frame" "$messages" >&2
{
  echo "command: $*"
  cat "$messages"
  if [ $rc -eq 0 ] && [ -n "$depfile" ] && [ -f "$depfile" ]; then
    echo "depends on:"
    cat "$depfile"
  fi
} > "$report"
rm -f "$messages"
exit $rc
