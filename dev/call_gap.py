"""Where a small forward's time goes: the GPU or the host.

`fusedattn bench` times each call between two CUDA events, so the host's work
before the launch (checks, allocation, tensor maps) counts when the GPU is
idle: at N=1K a call is about 100 us, and every microsecond of host time is 1%
of the ratio to cuDNN. For each method and shape this prints
  - event: the bench's measure (median of one call between events),
  - gpu: events around 100 calls back to back (the launches hide behind the
    kernels), per call,
  - host: the wall time to issue one call while the GPU is kept busy
    (torch.cuda._sleep first), so nothing waits on the GPU.

    python dev/call_gap.py [--shapes 64:1024:causal,128:1024:none] [--dtype float16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fusedattn import bench

parser = argparse.ArgumentParser()
parser.add_argument("--shapes", default="64:1024:causal,64:2048:causal,128:1024:none,128:4096:none",
                    help="head_dim:N:causal|none, comma separated (B=4, H=32, the bench's)")
parser.add_argument("--dtype", default="float16")
parser.add_argument("--methods", default="fusedattn,sdpa-cudnn")
args = parser.parse_args()
device = torch.device("cuda")
table = bench.methods(device)
names = args.methods.split(",")


def event_us(call) -> float:
    return statistics.median(bench._time_once(call, device) for _ in range(30)) * 1e6


def gpu_us(call, calls=100) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def host_us(call, calls=50) -> float:
    torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time: the calls below only queue
    start = time.perf_counter()
    for _ in range(calls):
        call()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / calls * 1e6


print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, B=4 H=32; us per call")
print("| d | N | causal | method | event | gpu | host | event - gpu |")
print("|---|---|---|---|---|---|---|---|")
with torch.no_grad():
    for shape in args.shapes.split(","):
        d, n, causal = shape.split(":")
        d, n, causal = int(d), int(n), causal == "causal"
        q, k, v = (torch.randn(4, 32, n, d, device=device, dtype=bench.DTYPES[args.dtype]) for _ in range(3))
        for name in names:
            call = lambda: table[name](q, k, v, causal)  # noqa: E731
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            e, g, h = event_us(call), gpu_us(call), host_us(call)
            print(f"| {d} | {n} | {causal} | {name} | {e:.1f} | {g:.1f} | {h:.1f} | {e - g:.1f} |")
