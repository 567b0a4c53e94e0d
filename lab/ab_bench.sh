#!/usr/bin/env bash
# Kernel versions side by side in one device call (the ladder's habit: every
# rung measured against the one before, same machine, same minutes).
# Here, in a checkout:
#   lab/ab_bench.sh export REF [REF ...]
# writes each git ref's tree into .ab/NN-<ref> (NN: the order given; the
# first is the baseline; git-ignored, about 2 MB each: name .ab in the device
# call's carry). There, on the CUDA machine:
#   lab/ab_bench.sh run OUTDIR [--rounds R] [bench arguments] [--and bench arguments]...
# installs every tree under .ab side by side (in a temporary folder, against
# that machine's torch) and times `fusedattn bench --no-progress ARGS` of each
# version per argument set (`--and` separates the sets, e.g. `--head-dim 128
# --and --head-dim 64`, so one build serves every table; a set holds bench
# arguments only: fusedattn reads no environment variables, and a NAME=value
# word is refused, since the versions before that change would read it and the
# others not, comparing two settings under one name). The versions alternate:
# R rounds (default 2) per set, in the given order, then reversed, and so on,
# and each row keeps the median time of its rounds (of two: their mean), which
# doubles the benches' time at the default; a version timed
# right after another runs on a warmer GPU, which at N=1K-4K moved a single
# order's ratios by 5-25% (docs/cuda-notes.md, "The band in 32 bits"). It
# writes OUTDIR/<name>-<set>.json and OUTDIR/ab.md: fusedattn's TFLOP/s (TB/s
# with --decode) per version and row, the ratio to the first version, the
# first version's other columns (pass --methods to keep them short; e.g.
# sdpa-cudnn gives the bar) and "best x M": the best version's rate (the
# first included) over column M. It uninstalls fusedattn from the environment
# (an installed one would be imported instead of the versions).
# The lent machine sends back 8 files (ab.md and sets.txt among them): with N
# versions and S sets keep N*S <= 6. A build takes about 40 s on the H200.
# Each version is timed by its own bench: `--decode` queues each interval's
# calls while the GPU sleeps from 4b141e1 on, and timed the host's launches
# too before it, so a decode A/B across that commit compares two measures.
#   lab/ab_bench.sh grid OUTDIR [--rounds R] [backward_grid.py args]
# installs every tree the same way and times the backward's key-block kernel
# alone with this checkout's lab/backward_grid.py (the same tool for every
# version), R rounds (default 2) alternating the order as above:
# OUTDIR/grid.txt, and grid.md (lab/ab_grid_table.py) with each version's
# median and its ratio to the first. Like run, it leaves no fusedattn
# installed in the environment: a test run after it builds again.
#   lab/ab_bench.sh ncu OUTDIR SHAPE [SHAPE ...]
# builds every tree the same way and times the forward kernel of each
# lab/ab_ncu_case.py SHAPE (e.g. d=128,N=8192,causal=1,dtype=bfloat16) under
# Nsight Compute at the GPU's base clock (--clock-control base), where boost
# clocks that move a row's rate 5-10% between runs do not reach: OUTDIR/ncu.md,
# each version's median kernel time and instructions per shape, the ratio to
# the first, and where its warps stalled (cycles per issued instruction).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: lab/ab_bench.sh export REF... | run OUTDIR [--rounds R] [bench args] [--and bench args]... | grid OUTDIR [--rounds R] [args] | ncu OUTDIR SHAPE...}
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
[ "$mode" = run ] || [ "$mode" = grid ] || [ "$mode" = ncu ] || { echo "ab_bench: unknown mode '$mode' (export, run, grid or ncu)"; exit 2; }

# Installs tree $1 (named $2) against this machine's torch (pip's further
# arguments after them: --target DIR installs beside the environment); says
# how long it took.
build() {
  local t0=$SECONDS tree=$1 name=$2
  shift 2
  if ! python3 -m pip install --no-build-isolation --no-deps -q "$@" "$tree" > "/tmp/ab-build-$name.log" 2>&1; then
    tail -20 "/tmp/ab-build-$name.log"
    echo "ab_bench: $name: BUILD FAILED"
    return 1
  fi
  echo "ab_bench: $name built in $((SECONDS - t0)) s"
}

# Installs every tree under .ab side by side under $1 (against this machine's
# torch), after taking an installed fusedattn out of the environment (an
# editable one's import hook above all would be imported instead); sets
# `names` to the versions that built and import from their own folder.
install_versions() {
  local installs=$1 dir name
  names=()
  python3 -m pip uninstall -y -q fusedattn > /dev/null 2>&1
  for dir in .ab/*/; do
    name=$(basename "$dir")
    build "$dir" "$name" --target "$installs/$name" || { status=1; continue; }
    if ! (cd /tmp && PYTHONPATH="$installs/$name" python3 -c \
          'import sys, fusedattn; assert fusedattn.__file__.startswith(sys.argv[1]), fusedattn.__file__' \
          "$installs/$name"); then
      echo "ab_bench: $name: another fusedattn is imported instead of this version"
      status=1
      continue
    fi
    names+=("$name")
  done
  [ ${#names[@]} -gt 0 ] || { echo "ab_bench: no version built"; exit 1; }
}

# The versions in round r's order: as given on odd rounds, reversed on even ones.
round_order() {
  local r=$1 j
  order=("${names[@]}")
  if ((r % 2 == 0)); then
    order=()
    for ((j = ${#names[@]} - 1; j >= 0; j--)); do order+=("${names[$j]}"); done
  fi
}

status=0
if [ "$mode" = grid ]; then
  out=${1:?usage: lab/ab_bench.sh grid OUTDIR [--rounds R] [backward_grid.py args]}
  shift
  rounds=2
  if [ "${1:-}" = --rounds ]; then
    rounds=${2:?--rounds needs a count}
    [[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "ab_bench: --rounds must be a positive count, got '$rounds'"; exit 2; }
    shift 2
  fi
  mkdir -p "$out"
  . lab/device_env.sh
  [ -d .ab ] || { echo "ab_bench: no .ab folder (lab/ab_bench.sh export REF... here, then carry .ab)"; exit 2; }
  tool="$PWD/lab/backward_grid.py"
  installs=$(mktemp -d /tmp/ab-installs.XXXXXX)
  trap 'rm -rf "$installs"' EXIT
  install_versions "$installs"
  : > "$out/grid.txt"
  for ((r = 1; r <= rounds; r++)); do
    round_order "$r"
    for name in "${order[@]}"; do
      (cd /tmp && PYTHONPATH="$installs/$name" python3 "$tool" --tag "$name" "$@") | tee -a "$out/grid.txt" ||
        status=1
    done
  done
  python3 lab/ab_grid_table.py "$out/grid.txt" > "$out/grid.md" || status=1
  cat "$out/grid.md"
  exit $status
fi

if [ "$mode" = ncu ]; then
  out=${1:?usage: lab/ab_bench.sh ncu OUTDIR SHAPE [SHAPE ...]}
  shift
  [ $# -gt 0 ] || { echo "ab_bench: ncu needs at least one shape, e.g. d=128,N=8192,causal=1,dtype=bfloat16"; exit 2; }
  mkdir -p "$out"
  . lab/device_env.sh
  command -v ncu > /dev/null 2>&1 || { echo "ab_bench: ncu not found"; exit 1; }
  [ -d .ab ] || { echo "ab_bench: no .ab folder (lab/ab_bench.sh export REF... here, then carry .ab)"; exit 2; }
  case_py="$PWD/lab/ab_ncu_case.py"
  csv_dir="$out/csv"  # kept: a table that reads wrong is checked against them
  mkdir -p "$csv_dir"
  rm -f "$csv_dir"/*.csv "$csv_dir"/*.err  # a version that fails to build leaves no older run's behind
  # Named here, not in the subshell below: from /tmp the relative path finds
  # nothing, and ncu given no metrics collects its default sections instead.
  metrics=$(python3 lab/ab_ncu_table.py --metrics) || exit 1
  python3 -m pip uninstall -y -q fusedattn > /dev/null 2>&1
  for dir in .ab/*/; do
    name=$(basename "$dir")
    build "$dir" "$name" || continue
    # Every launch of the forward kernels (sm90_forward_kernel, forward_kernel):
    # the table keeps the profiled calls of each shape, the warm-up ones dropped.
    (cd /tmp && timeout 300 ncu --clock-control base --print-units base --kernel-name regex:'forward_kernel' --csv \
      --metrics "$metrics" python3 "$case_py" "$@") \
      > "$csv_dir/$name.csv" 2> "$csv_dir/$name.err" || { tail -5 "$csv_dir/$name.err"; echo "ab_bench: $name: ncu failed"; }
  done
  python3 lab/ab_ncu_table.py "$csv_dir" "$@" > "$out/ncu.md"
  cat "$out/ncu.md"
  exit 0
fi

out=${1:?usage: lab/ab_bench.sh run OUTDIR [--rounds R] [bench args] [--and bench args]...}
shift
rounds=2
if [ "${1:-}" = --rounds ]; then
  rounds=${2:?--rounds needs a count}
  [[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "ab_bench: --rounds must be a positive count, got '$rounds'"; exit 2; }
  shift 2
fi
# The argument sets, one string each (bench arguments have no spaces).
sets=("")
for arg in "$@"; do
  if [[ $arg =~ ^[A-Z_][A-Z0-9_]*= ]]; then
    echo "ab_bench: '$arg': a set holds bench arguments only (fusedattn reads no environment variables)"
    exit 2
  fi
  if [ "$arg" = --and ]; then sets+=(""); else sets[-1]+="${sets[-1]:+ }$arg"; fi
done
mkdir -p "$out"
. lab/device_env.sh
[ -d .ab ] || { echo "ab_bench: no .ab folder (lab/ab_bench.sh export REF... here, then carry .ab)"; exit 2; }
installs=$(mktemp -d /tmp/ab-installs.XXXXXX)
rounds_dir=$(mktemp -d)
trap 'rm -rf "$installs" "$rounds_dir"' EXIT
install_versions "$installs"
failed=()
for i in "${!sets[@]}"; do
  # shellcheck disable=SC2206  # the set's arguments, split on purpose (they have no spaces)
  args=(${sets[$i]})
  for ((r = 1; r <= rounds; r++)); do
    round_order "$r"
    for name in "${order[@]}"; do
      json="$rounds_dir/$name-$((i + 1))-$r.json"
      # From /tmp, so that the checkout's python/ does not shadow the install.
      if ! (cd /tmp && PYTHONPATH="$installs/$name" timeout "${FUSEDATTN_BENCH_TIMEOUT:-300}" \
            python3 -m fusedattn bench --no-progress --json "$json" "${args[@]}" > /dev/null); then
        echo "ab_bench: $name: bench failed (set $((i + 1)), round $r: ${sets[$i]})"
        failed+=("$name")
        status=1
      fi
    done
  done
done
kept=()
for name in "${names[@]}"; do
  [[ " ${failed[*]} " == *" $name "* ]] || kept+=("$name")
done
names=("${kept[@]}")
[ ${#names[@]} -gt 0 ] || { echo "ab_bench: no version ran"; exit 1; }
# Each version's rounds of a set as one JSON: every method's time per row is
# the median of its rounds (the rate follows it).
python3 - "$rounds_dir" "$out" "${#sets[@]}" "$rounds" "${names[@]}" <<'PY' || status=1
import json, pathlib, statistics, sys
rounds_dir, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
n_sets, rounds, names = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
for name in names:
    for i in range(1, n_sets + 1):
        runs = [json.loads((rounds_dir / f"{name}-{i}-{r}.json").read_text()) for r in range(1, rounds + 1)]
        merged = runs[0]
        ident = lambda row: {k: row.get(k) for k in ("dtype", "causal", "seqlen", "varlen")}  # noqa: E731
        for row_index, row in enumerate(merged["rows"]):
            assert all(ident(run["rows"][row_index]) == ident(row) for run in runs), (name, i, row_index)
            first_fused = row["results"].get("fusedattn", {}).get("seconds")
            for method, result in row["results"].items():
                times = [run["rows"][row_index]["results"].get(method, {}) for run in runs]
                times = [t["seconds"] for t in times if t.get("status", "ok") == "ok" and t.get("seconds")]
                if result.get("status", "ok") != "ok" or not times:
                    continue
                median = statistics.median(times)
                for rate in ("tflops", "tb_per_s"):
                    if rate in result:
                        result[rate] *= result["seconds"] / median
                result["seconds"] = median
            # What the bench derived from the times, again from the medians.
            fused = row["results"].get("fusedattn", {})
            if fused.get("status", "ok") == "ok" and first_fused:
                if "fusedattn_pct_of_matmul" in row:
                    row["fusedattn_pct_of_matmul"] *= first_fused / fused["seconds"]
                row["fusedattn_speedup"] = {m: r["seconds"] / fused["seconds"] for m, r in row["results"].items()
                                            if m != "fusedattn" and r.get("status", "ok") == "ok"}
        merged["ab_rounds"] = rounds
        (out / f"{name}-{i}.json").write_text(json.dumps(merged, indent=1))
PY
printf '%s\n' "${sets[@]}" > "$out/sets.txt"
python3 - "$out" "${#sets[@]}" "${names[@]}" <<'PY' > "$out/ab.md" || status=1
import json, pathlib, sys
out, n_sets, names = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
sets = (out / "sets.txt").read_text().splitlines()
def load(name, i):
    return json.loads((out / f"{name}-{i}.json").read_text())
first = load(names[0], 1)
print(f"{first['device']}, torch {first['torch']}, {first['date']}; fusedattn TFLOP/s (TB/s with "
      f"--decode), 'x' = over {names[0]}; other columns: {names[0]}'s run\n")
def key(r):
    if "varlen" in r:  # --decode rows
        return r["dtype"], "1..N" if r["varlen"] else "all N", r["seqlen"]
    return r["dtype"], "yes" if r["causal"] else "no", r["seqlen"]
def rate(result):
    return result.get("tflops", result.get("tb_per_s")) if result.get("status", "ok") == "ok" else None
def cell(v):
    return (f"{v:.1f}" if v >= 10 else f"{v:.2f}") if v else "-"
for i in range(1, n_sets + 1):
    runs = {n: load(n, i) for n in names}
    base_run = runs[names[0]]
    others = [m for m in base_run["methods"] if m != "fusedattn"]
    config = " ".join(f"{k}={v}" for k, v in base_run["config"].items() if k not in ("seqlens", "dtypes"))
    print(f"### set {i}: {config} ({sets[i - 1]})\n")
    print("| dtype | causal or lengths | N | " + " | ".join(names + others)
          + " | " + " | ".join(f"x {n}" for n in names[1:])
          + "".join(f" | best x {m}" for m in others) + " |")
    print("|" + "---|" * (3 + 2 * len(names) - 1 + 2 * len(others)))
    rates = {n: {key(r): rate(r["results"]["fusedattn"]) for r in run["rows"]} for n, run in runs.items()}
    for r in base_run["rows"]:
        k = key(r)
        values = [rates[n].get(k) for n in names]
        other_values = [rate(r["results"].get(m, {"status": "missing"})) for m in others]
        base, best = values[0], max((v for v in values if v), default=None)
        ratios = [f"{v / base:.3f}" if v and base else "-" for v in values[1:]]
        bars = [f"{best / o:.3f}" if best and o else "-" for o in other_values]
        print(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join([cell(v) for v in values + other_values] + ratios + bars) + " |")
    print()
PY
cat "$out/ab.md"
exit $status
