"""Where a small forward's time goes: the GPU or the host.

`fusedattn bench` times each call between two CUDA events, so the host's work
before the launch (checks, allocation, tensor maps) counts when the GPU is
idle: at N=1K a call is about 100 us, and every microsecond of host time is 1%
of the ratio to cuDNN. For each method and shape this prints
  - event: the forward bench's measure (median of one call between events),
  - gpu: events around 100 calls back to back (the launches hide behind the
    kernels), per call,
  - queued: the same calls as event, queued while the GPU sleeps
    (`fusedattn bench --decode`'s measure since 2026-12-01, --launch-gaps
    gives event),
  - cold: one call between events after a 256 MB write that evicts L2
    (triton.testing.do_bench's measure, which ../shared/anchors used for
    SDPA's decode rows); the write (about 60 us) hides most of the call's
    launch, not all of a host time as long as SDPA cuDNN's,
  - host: the wall time to issue one call while the GPU is kept busy
    (torch.cuda._sleep first), so nothing waits on the GPU.

    python lab/call_gap.py [--shapes 64:1024:causal,128:1024:none] [--dtype float16]

With --decode the shapes are kv_heads:N:all|varlen, decoding steps of
`fusedattn bench --decode` (B=8, Hq=32, d=128, one query; varlen: its
per-sequence lengths in [1, N]), and event and queued take 10 calls between
two events, per call (event is `fusedattn bench --decode --launch-gaps`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fusedattn import bench, bench_decode

parser = argparse.ArgumentParser()
parser.add_argument("--shapes", default="64:1024:causal,64:2048:causal,128:1024:none,128:4096:none",
                    help="head_dim:N:causal|none, comma separated (B=4, H=32, the bench's)")
parser.add_argument("--dtype", default="float16")
parser.add_argument("--methods", default="fusedattn,sdpa-cudnn")
parser.add_argument("--decode", action="store_true", help="shapes are kv_heads:N:all|varlen decoding steps")
args = parser.parse_args()
device = torch.device("cuda")
names = args.methods.split(",")
calls_per_event = bench_decode.CALLS_PER_TIMING if args.decode else 1


def event_us(call) -> float:
    def calls():
        for _ in range(calls_per_event):
            call()
    return statistics.median(bench._time_once(calls, device) for _ in range(30)) * 1e6 / calls_per_event


def gpu_us(call, calls=100) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def queued_us(call) -> float:
    def calls():
        for _ in range(calls_per_event):
            call()
    timer = bench_decode.QueuedTiming(calls, device, calls_per_event)
    return statistics.median(timer() for _ in range(30)) * 1e6


def cold_us(call, reps=30) -> float:
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1e3


def host_us(call, calls=50) -> float:
    torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time: the calls below only queue
    start = time.perf_counter()
    for _ in range(calls):
        call()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / calls * 1e6


def report(label: str, name: str, call) -> None:
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    e, q, g, c, h = event_us(call), queued_us(call), gpu_us(call), cold_us(call), host_us(call)
    print(f"| {label} | {name} | {e:.1f} | {q:.1f} | {g:.1f} | {c:.1f} | {h:.1f} | {e - g:.1f} |")


def forward_shapes() -> None:
    table = bench.methods(device)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, B=4 H=32; us per call")
    print("| d N causal | method | event | queued | gpu | cold | host | event - gpu |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        d, n, causal = shape.split(":")
        d, n, causal = int(d), int(n), causal == "causal"
        q, k, v = (torch.randn(4, 32, n, d, device=device, dtype=bench.DTYPES[args.dtype]) for _ in range(3))
        for name in names:
            report(f"{d} {n} {causal}", name, lambda: table[name](q, k, v, causal))


def decode_shapes() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, B=8 Hq=32 d=128; us per call")
    print("| Hkv N lengths | method | event | queued | gpu | cold | host | event - gpu |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        kv_heads, n, lengths = shape.split(":")
        cfg = bench_decode.DecodeConfig(kv_heads=int(kv_heads), device=device)
        table = bench_decode.methods(cfg)
        dt = bench.DTYPES[args.dtype]
        q = torch.randn(cfg.batch, cfg.heads, 1, cfg.head_dim, device=device, dtype=dt)
        k, v = (torch.randn(cfg.batch, cfg.kv_heads, int(n), cfg.head_dim, device=device, dtype=dt) for _ in range(2))
        varlen = lengths == "varlen"
        seqlens = bench_decode.cache_lengths(cfg, int(n), varlen).to(device)
        for name in names:
            if varlen and name != "fusedattn":
                continue
            report(f"{kv_heads} {n} {lengths}", name, lambda: table[name](q, k, v, seqlens, None))


with torch.no_grad():
    if args.decode:
        decode_shapes()
    else:
        forward_shapes()
