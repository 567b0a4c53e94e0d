#!/usr/bin/env bash
# On a CUDA machine with PyTorch installed and no network: build fusedattn
# against that torch, run the whole test suite (the GPU group included) and the
# benchmark, and write logs and JSON into OUTDIR. The lent machine sends back
# 8 files at most: build.log always, tests.log, sanitizer.log, bench.{json,
# png,txt}, profile.txt, profile-decode.txt, decode-splits.md, roofline.md,
# and six JSON from "tables"; pick stages
# per call so that their files fit. Each stage has a time limit, so that a
# hang costs one stage, not the whole device call.
#   lab/gpu_check.sh OUTDIR [extra fusedattn bench arguments]
# GPU_CHECK_STAGES picks stages (default "build tests sanitizer bench";
# "profile" runs Nsight Compute on the main kernels, "profile_decode" on the
# decode kernel, "profile_decode_short" the decode step's kernels at 4K,
# "profile_decode_vs_cudnn" ours and cuDNN's decode kernels at 32K, "profile_sdpa_decode" on cuDNN's, "profile_forward_vs_cudnn" the forward
# against cuDNN's at 4K and 8K, "decode_tables" three decode tables (MHA, GQA, d=64), "call_gap" times small
# forwards' host and GPU time, "decode_splits" the decode table by split count, "roofline" the KV-cache
# streaming ceilings, "roofline_gqa" the same at GQA 32/8's bytes, "schedule" that ceiling under four
# schedules, "tables" the tables of README.md's Performance section). On the H200 "build
# tests" take about 4 minutes, the sanitizer up to 10 (each tool stops at
# FUSEDATTN_SANITIZER_TIMEOUT, 300 s) and the benchmark up to
# FUSEDATTN_BENCH_TIMEOUT (300 s; --backward over the whole grid needs more:
# pass --methods sdpa-flash,sdpa-cudnn or fewer --seqlens), so give each its
# own call when a call is limited to 10.
# Target and compiler: lab/device_env.sh.
set -uo pipefail
out=${1:?usage: lab/gpu_check.sh OUTDIR [bench args]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
. lab/device_env.sh
status=0

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  nvcc --version | tail -1
  echo "CXX=${CXX:-c++} ($(${CXX:-c++} --version | head -1))"
} 2>&1 | tee "$out/build.log"

stage_build() {
  local t0=$SECONDS cache cached want
  # A build dir configured with another compiler keeps it (CMake caches it):
  # a build there after a plain `pip install .` on the lent image would reuse
  # /opt/gcc's objects, whose first formatted error message crashes. Start over.
  want=$(readlink -f "$(command -v "${CXX:-c++}")")
  for cache in build/*/CMakeCache.txt; do
    [ -f "$cache" ] || continue
    cached=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$cache")
    if [ "$(readlink -f "$cached")" != "$want" ]; then
      echo "gpu_check: $(dirname "$cache") was configured with $cached, not $want; removing it"
      rm -rf "$(dirname "$cache")"
    fi
  done
  if ! python3 -m pip install --no-build-isolation --no-deps -v . >> "$out/build.log" 2>&1; then
    tail -40 "$out/build.log"
    echo "gpu_check: BUILD FAILED (see build.log)"
    exit 1
  fi
  echo "built in $((SECONDS - t0)) s"
  grep -E "building CUDA kernels" "$out/build.log" | tail -1
}

# The GPU tests only (marker gpu; CI runs the rest on its CPU), one line per
# test in tests.log, so a run the timeout stops still says which failed.
# FUSEDATTN_TEST_MARK="" runs the whole suite.
stage_tests() {
  (cd tests && timeout "${FUSEDATTN_TEST_TIMEOUT:-420}" python3 -m pytest -v -p no:cacheprovider -rfs \
    --tb=short -m "${FUSEDATTN_TEST_MARK-gpu}" .) > "$out/tests.log" 2>&1
  [ $? -eq 0 ] || status=1
  grep -E " (FAILED|ERROR)" "$out/tests.log" | head -40
  tail -3 "$out/tests.log"
}

# racecheck of the sm90 kernels ran past 180 s on the H200 (2026-11-30).
# FUSEDATTN_SANITIZER_GROUPS="kvcache" (or "attention", "deterministic") runs one group of
# lab/sanitizer_cases.py.
stage_sanitizer() {
  if ! command -v compute-sanitizer >/dev/null 2>&1; then
    echo "compute-sanitizer not found"
    return
  fi
  local tool rc
  for tool in memcheck racecheck; do
    # shellcheck disable=SC2086  # the groups are words
    timeout "${FUSEDATTN_SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --error-exitcode 9 python3 lab/sanitizer_cases.py ${FUSEDATTN_SANITIZER_GROUPS:-} \
      > "$out/sanitizer.tmp" 2>&1
    rc=$?
    echo "$tool: exit $rc, $(grep -c -E '^========= (Invalid|Error|Race)' "$out/sanitizer.tmp") reports"
    tail -3 "$out/sanitizer.tmp"
    { echo "== $tool (exit $rc)"; cat "$out/sanitizer.tmp"; } >> "$out/sanitizer.log"
    rm -f "$out/sanitizer.tmp"
    [ $rc -eq 0 ] || status=1
  done
}

stage_bench() {
  local plot=(--plot "$out/bench.png")
  [[ " $* " == *" --decode "* ]] && plot=()  # the decode table has no plot
  timeout "${FUSEDATTN_BENCH_TIMEOUT:-300}" fusedattn bench --no-progress --json "$out/bench.json" "${plot[@]}" "$@" 2>&1 | tee "$out/bench.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

# Not in the default stages: the tables of README.md's Performance section,
# with its commands (~5 minutes on an H200): forward and forward + backward at
# d=128 and d=64 against every SDPA backend, fp16 and bf16, causal and not,
# then decoding (MHA in both dtypes, GQA 32/8). One JSON per table, named as
# in docs/bench/readme/; lab/readme_tables.py renders them.
stage_tables() {
  local methods=sdpa-flash,sdpa-efficient,sdpa-cudnn d
  for d in 128 64; do
    timeout 240 fusedattn bench --no-progress --methods "$methods" --head-dim "$d" --dtype float16,bfloat16 \
      --json "$out/forward-d$d.json" > /dev/null 2>&1 || { echo "forward d=$d failed"; status=1; }
    timeout 300 fusedattn bench --no-progress --backward --methods "$methods" \
      --head-dim "$d" --dtype float16,bfloat16 --seqlens 1024,2048,4096,8192,16384 \
      --json "$out/backward-d$d.json" > /dev/null 2>&1 || { echo "backward d=$d failed"; status=1; }
  done
  timeout 120 fusedattn bench --no-progress --decode --dtype float16,bfloat16 --methods sdpa-cudnn,sdpa-flash \
    --json "$out/decode-mha.json" > /dev/null 2>&1 || { echo "decode (MHA) failed"; status=1; }
  timeout 120 fusedattn bench --no-progress --decode --kv-heads 8 --methods sdpa-cudnn,sdpa-flash \
    --json "$out/decode-gqa.json" > /dev/null 2>&1 || { echo "decode (GQA) failed"; status=1; }
  python3 lab/readme_tables.py forward "$out"/forward-d128.json "$out"/forward-d64.json || status=1
  python3 lab/readme_tables.py forward "$out"/backward-d128.json "$out"/backward-d64.json || status=1
  python3 lab/readme_tables.py decode "$out"/decode-mha.json "$out"/decode-gqa.json || status=1
}

# Not in the default stages: three decode tables (d=128 fp16 and
# bf16 against cuDNN and FlashAttention, GQA 32/8, d=64), JSON each, ~3
# minutes; with "roofline roofline_gqa" in the same call they give every row
# its ceiling on the same machine.
stage_decode_tables() {
  local name args
  for name in mha gqa d64; do
    case $name in
      mha) args=(--dtype float16,bfloat16 --methods sdpa-cudnn,sdpa-flash) ;;
      gqa) args=(--kv-heads 8 --methods sdpa-cudnn,sdpa-flash) ;;
      d64) args=(--head-dim 64 --methods sdpa-cudnn) ;;
    esac
    echo "== $name: fusedattn bench --decode ${args[*]}"
    timeout 150 fusedattn bench --no-progress --decode "${args[@]}" --json "$out/decode-$name.json" 2>&1 ||
      status=1
  done > "$out/decode-tables.txt"
  grep -E '^== |^\| +(float16|bfloat16)' "$out/decode-tables.txt"
}

# Nsight Compute, for the profile stages: where it is missing they say so and
# do nothing.
have_ncu() {
  command -v ncu >/dev/null 2>&1 && return
  echo "ncu not found"
  return 1
}

# Not in the default stages: Nsight Compute on the forward's and the
# backward's main kernels (B=4 H=32 d=128 N=4K fp16), the counters that say
# what limits them.
stage_profile() {
  have_ncu || return
  timeout 300 ncu --clock-control none --launch-skip 2 --launch-count 2 \
    -k regex:"sm90_forward_kernel|sm90_backward_kernel|forward_kernel|backward_kernel" --set full \
    python3 lab/profile_cases.py > "$out/profile.txt" 2>&1 || status=1
  grep -E "^  [a-z_0-9]+.*\(|Duration|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|Stall|Tensor" \
    "$out/profile.txt" | head -60
}

# Not in the default stages: Nsight Compute on the decode kernel at N=32K,
# the stall reasons behind its gap to the roofline below.
stage_profile_decode() {
  have_ncu || return
  timeout 300 ncu --clock-control none --launch-skip 1 --launch-count 1 -k regex:"decode_kernel" --set full \
    python3 lab/profile_cases.py --decode --seqlen 32768 > "$out/profile-decode.txt" 2>&1 || status=1
  grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy|Stall|Issue Slots Busy|Warp Cycles Per Issued" \
    "$out/profile-decode.txt" | head -60
}

# Not in the default stages: the decode step's kernels at N=4K (GQA 32/8, all
# full, then per-sequence lengths), each kernel's duration and DRAM
# throughput: what a short step spends besides streaming.
stage_profile_decode_short() {
  have_ncu || return
  for case in "--kv-heads 8" "--kv-heads 8 --varlen" "--varlen"; do
    echo "== $case"
    # shellcheck disable=SC2086  # the case's arguments, split on purpose
    timeout 120 ncu --clock-control none --launch-count 4 -k regex:"decode_kernel" \
      --section SpeedOfLight --section LaunchStats python3 lab/profile_cases.py --decode --seqlen 4096 $case 2>&1 ||
      status=1
  done > "$out/profile-decode-short.txt"
  grep -E "^== |^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Grid Size" "$out/profile-decode-short.txt" | head -60
}

# Not in the default stages: the kernels SDPA's cuDNN backend runs for the
# decode table's row (q of 1 token, N=32K): names, grid, block, registers,
# shared memory and DRAM throughput, to compare with ours.
stage_profile_sdpa_decode() {
  have_ncu || return
  timeout 300 ncu --clock-control none --set basic \
    python3 lab/profile_cases.py --decode --sdpa-cudnn --seqlen 32768 > "$out/profile-sdpa-decode.txt" 2>&1 || status=1
  grep -E "^  [A-Za-z_0-9].*\(|Duration|DRAM Throughput|Memory Throughput|Registers Per Thread|Grid Size|Block Size|Shared Memory Config|Dynamic Shared|Static Shared|Cluster Size|Waves Per SM" \
    "$out/profile-sdpa-decode.txt" | head -80
}

# Not in the default stages: the forward's kernel and cuDNN's at d=128,
# non-causal N=4K and 8K (cuDNN's fastest point and the next): duration, SM
# clock, DRAM and L2 traffic, launch shape (the second call of each).
stage_profile_forward_vs_cudnn() {
  have_ncu || return
  local n who
  for n in 4096 8192; do
    for who in "" --sdpa-cudnn; do
      echo "== N=$n ${who:-fusedattn}"
      timeout 120 ncu --clock-control none -k regex:"sm90_forward_kernel|cudnn" --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section LaunchStats --section Occupancy \
        --metrics lts__t_sector_hit_rate.pct,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active \
        python3 lab/profile_cases.py --forward-only --seqlen "$n" $who 2>&1 || status=1
    done
  done > "$out/profile-forward-vs-cudnn.txt"
  grep -E "^== |^  [A-Za-z_0-9].*\(|Duration|SM Frequency|DRAM Throughput|Compute \(SM\)|Grid Size|Registers Per|Dynamic Shared|Cluster Size|lts__t_sector_hit|dram__bytes_read|Achieved Occupancy" \
    "$out/profile-forward-vs-cudnn.txt" | head -80
}

# Not in the default stages: the decode kernel (one split) and cuDNN's at
# N=32K, same grid: duration, clocks, DRAM and L2 traffic, and the memory
# pipeline (what our 5% gap to cuDNN is made of).
stage_profile_decode_vs_cudnn() {
  have_ncu || return
  local who
  for who in "" --sdpa-cudnn; do
    echo "== ${who:-fusedattn}"
    timeout 120 ncu --clock-control none -k regex:"decode_kernel|cudnn" \
      --launch-skip 1 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_read.sum,lts__t_sector_hit_rate.pct,lts__t_requests_srcunit_tex_op_read.sum,dram__cycles_elapsed.avg.per_second,gpc__cycles_elapsed.avg.per_second \
      python3 lab/profile_cases.py --decode --seqlen 32768 --num-splits 1 $who 2>&1 || status=1
  done > "$out/profile-decode-vs-cudnn.txt"
  grep -E "^== |^  [A-Za-z_0-9].*\(|Duration|Frequency|DRAM Throughput|Memory Throughput|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth|dram__|lts__|gpc__" \
    "$out/profile-decode-vs-cudnn.txt" | head -60
}

# Not in the default stages: event, GPU and host time per call of small
# forwards, fusedattn against cuDNN (lab/call_gap.py).
stage_call_gap() {
  timeout 120 python3 lab/call_gap.py 2>&1 | tee "$out/call-gap.md"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

# Not in the default stages: the decode table with the split count forced
# (--num-splits) to each of DECODE_SPLITS, against the planner's
# own choice (the first rows); DECODE_SPLITS_ARGS are the bench's arguments
# (default: 32K and 128K, full caches, B=8 H=32 d=128); ~2 minutes.
stage_decode_splits() {
  local s forced
  local args=(${DECODE_SPLITS_ARGS:---seqlens 32768,131072 --lengths full})
  {
    echo "decode TB/s by forced split count (fusedattn bench --decode ${args[*]})"
    # Forced counts are capped at kMaxDecodeSplits (64).
    for s in auto ${DECODE_SPLITS:-4 8 16 24 32 33 48 64}; do
      echo "== splits $s"
      forced=()
      [ "$s" = auto ] || forced=(--num-splits "$s")
      timeout 120 fusedattn bench --no-progress --decode "${args[@]}" "${forced[@]}" \
        --methods sdpa-cudnn > /tmp/decode-splits.txt 2>&1 || { status=1; tail -3 /tmp/decode-splits.txt; }
      grep -E '^\| +(dtype|float16|bfloat16)' /tmp/decode-splits.txt
    done
  } > "$out/decode-splits.md"
  cat "$out/decode-splits.md"
}

# Not in the default stages: how fast each load path (cp.async, bulk copies
# per row or per tile, TMA boxes) streams a KV cache with no attention maths,
# the ceiling for the decode kernel (lab/cuda/stream_roofline.cu, ~1 minute).
build_roofline() {
  nvcc -std=c++17 -O3 -Icpp/include -gencode=arch=compute_90a,code=sm_90a \
    lab/cuda/stream_roofline.cu cpp/cuda/hopper/tensor_maps.cu -o /tmp/stream_roofline || { status=1; return 1; }
}
stage_roofline() {
  build_roofline || return
  timeout 300 /tmp/stream_roofline > "$out/roofline.md" 2>&1 || status=1
  cat "$out/roofline.md"
}

# Not in the default stages: the roofline's stream at GQA 32/8's bytes (8 kv
# heads) over split counts, the ceiling for the decode table's GQA rows.
stage_roofline_gqa() {
  build_roofline || return
  timeout 120 /tmp/stream_roofline 8 > "$out/roofline-gqa.md" 2>&1 || status=1
  cat "$out/roofline-gqa.md"
}

# Not in the default stages: the streaming ceiling under four schedules
# (a block per item and split, stream-K, runs from an atomic counter, runs
# taken item by item and then from other items' counters) and with plain
# loads into registers instead of the ring, at the
# decode table's 4K and 32K rows, full and with the bench's lengths 1..N
# (lab/cuda/stream_schedule.cu, ~30 s; the lengths come from the installed
# package, so on a fresh machine run "build schedule").
stage_schedule() {
  nvcc -std=c++17 -O3 -Icpp/include -gencode=arch=compute_90a,code=sm_90a \
    lab/cuda/stream_schedule.cu -o /tmp/stream_schedule || { status=1; return 1; }
  for heads in 32 8; do
    for n in 4096 32768; do
      local lengths
      lengths=$(python3 -c "from fusedattn.bench_decode import DecodeConfig, cache_lengths
print(*cache_lengths(DecodeConfig(device='cpu'), $n, True).tolist())") || { status=1; return 1; }
      timeout 60 /tmp/stream_schedule "$heads" "$n" || status=1
      echo
      timeout 60 /tmp/stream_schedule "$heads" "$n" $lengths || status=1
      echo
    done
  done > "$out/schedule.md" 2>&1
  cat "$out/schedule.md"
}

for stage in ${GPU_CHECK_STAGES:-build tests sanitizer bench}; do
  echo "== $stage"
  "stage_$stage" "$@"
done

echo "gpu_check: exit $status"
exit $status
