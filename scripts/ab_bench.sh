#!/usr/bin/env bash
# Kernel versions side by side in one device call (the ladder's habit: every
# rung measured against the one before, same machine, same minutes).
# Here, in a checkout:
#   scripts/ab_bench.sh export REF [REF ...]
# writes each git ref's tree into .ab/NN-<ref> (NN: the order given; the
# first is the baseline; git-ignored, about 2 MB each: name .ab in the device
# call's carry). There, on the CUDA machine:
#   scripts/ab_bench.sh run OUTDIR [fusedattn bench arguments]
# builds every tree under .ab in turn against that machine's torch, times
# `fusedattn bench --no-progress ARGS` with each (fusedattn's column only is
# compared: pass --methods to keep the other columns short), and writes
# OUTDIR/<name>.json and OUTDIR/ab.md, fusedattn's TFLOP/s (TB/s with
# --decode) per version and row, with the ratio to the first version. The
# last version stays installed. The lent machine sends back 8 files: 7
# versions at most. A build takes about 40 s on the H200.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: scripts/ab_bench.sh export REF... | run OUTDIR [bench args]}
shift

if [ "$mode" = export ]; then
  exclude="$(git rev-parse --git-common-dir)/info/exclude"
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.ab/' "$exclude" 2>/dev/null || echo '/.ab/' >> "$exclude"
  rm -rf .ab  # only this export's versions travel
  i=1
  for ref in "$@"; do
    # Numbered in the order given (the first is the baseline), named in the
    # characters the lent machine sends back.
    dir=".ab/$(printf %02d "$i")-${ref//[^A-Za-z0-9._-]/-}"
    mkdir -p "$dir"
    git archive "$ref" | tar -x -C "$dir" || exit 1
    echo "$dir: $(git log -1 --format='%h %s' "$ref" | cut -c1-100)"
    i=$((i + 1))
  done
  exit 0
fi
[ "$mode" = run ] || { echo "ab_bench: unknown mode '$mode' (export or run)"; exit 2; }

out=${1:?usage: scripts/ab_bench.sh run OUTDIR [bench args]}
shift
mkdir -p "$out"
. scripts/device_env.sh
[ -d .ab ] || { echo "ab_bench: no .ab folder (scripts/ab_bench.sh export REF... here, then carry .ab)"; exit 2; }
status=0
names=()
for dir in .ab/*/; do
  name=$(basename "$dir")
  t0=$SECONDS
  if ! python3 -m pip install --no-build-isolation --no-deps -q "$dir" > "/tmp/ab-build-$name.log" 2>&1; then
    tail -20 "/tmp/ab-build-$name.log"
    echo "ab_bench: $name: BUILD FAILED"
    status=1
    continue
  fi
  echo "ab_bench: $name built in $((SECONDS - t0)) s"
  rm -f "$out/$name.json"
  if timeout "${FUSEDATTN_BENCH_TIMEOUT:-300}" fusedattn bench --no-progress --json "$out/$name.json" "$@" > /dev/null; then
    names+=("$name")
  else
    echo "ab_bench: $name: bench failed"
    status=1
  fi
done
[ ${#names[@]} -gt 0 ] || { echo "ab_bench: no version ran"; exit 1; }
python3 - "$out" "${names[@]}" <<'PY' > "$out/ab.md" || status=1
import json, pathlib, sys
out, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
runs = {n: json.loads((out / f"{n}.json").read_text()) for n in names}
first = runs[names[0]]
print(f"{first['device']}, torch {first['torch']}, {first['date']}; fusedattn TFLOP/s (TB/s with "
      f"--decode), 'x' = over {names[0]}\n")
print("| dtype | causal or lengths | N | " + " | ".join(names) + " | " + " | ".join(f"x {n}" for n in names[1:]) + " |")
print("|" + "---|" * (3 + 2 * len(names) - 1))
def key(r):
    if "varlen" in r:  # --decode rows
        return r["dtype"], "1..N" if r["varlen"] else "all N", r["seqlen"]
    return r["dtype"], "yes" if r["causal"] else "no", r["seqlen"]
def rate(r):
    result = r["results"]["fusedattn"]
    return result.get("tflops", result.get("tb_per_s"))
tflops = {n: {key(r): rate(r) for r in run["rows"]} for n, run in runs.items()}
for k in tflops[names[0]]:
    values = [tflops[n].get(k) for n in names]
    base = values[0]
    cells = [(f"{v:.1f}" if v >= 10 else f"{v:.2f}") if v else "-" for v in values]
    ratios = [f"{v / base:.3f}" if v and base else "-" for v in values[1:]]
    print(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cells + ratios) + " |")
PY
cat "$out/ab.md"
exit $status
