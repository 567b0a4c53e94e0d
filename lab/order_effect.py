"""Does the order in which the bench times two methods change their ratio?

Under Nsight Compute (2026-12-01, H200) our d=128 forward took 1.62 ms at
non-causal N=4K and cuDNN's 1.66 ms, while `fusedattn bench` (cuDNN's cell
timed first, then ours) read 0.90-0.94x there. The H200 runs these kernels at
its power limit, so its clock depends on what ran just before. This times the
same two methods three ways at each size: in blocks as the bench does (every
repeat of one, then every repeat of the other), in blocks in the other order,
and interleaved (one call of each per repeat, the order alternating).

    python lab/order_effect.py [--seqlens 2048,4096,8192] [--dtype float16] [--repeats 20]
"""

from __future__ import annotations

import argparse

import torch

from fusedattn import bench

parser = argparse.ArgumentParser()
parser.add_argument("--seqlens", default="2048,4096,8192")
parser.add_argument("--dtype", default="float16")
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--causal", action="store_true")
parser.add_argument("--repeats", type=int, default=20)
args = parser.parse_args()
device = torch.device("cuda")
table = bench.methods(device)
names = ["sdpa-cudnn", "fusedattn"]
cfg = bench.Config(device, 4, 32, args.head_dim, [], [args.dtype], [args.causal], args.repeats, 3)


def blocks(calls, order):
    """Median seconds per method, every repeat of one before the next's."""
    return {name: bench.median_seconds(calls[name], cfg) for name in order}


def interleaved(calls):
    """Median seconds per method, timed as the bench does (bench.interleaved_medians)."""
    for name in names:
        for _ in range(cfg.warmup):
            calls[name]()
    return bench.interleaved_medians({name: lambda c=calls[name]: bench._time_once(c, device) for name in names},
                                     cfg.repeats)


print(f"{torch.cuda.get_device_name()}, {args.dtype}, d={args.head_dim}, causal={args.causal}, "
      f"{args.repeats} repeats; TFLOP/s (median), fusedattn over cuDNN")
print("| N | way | cuDNN | fusedattn | ratio |")
print("|---|---|---|---|---|")
with torch.no_grad():
    for n in (int(s) for s in args.seqlens.split(",")):
        q, k, v = (torch.randn(4, 32, n, args.head_dim, device=device, dtype=bench.DTYPES[args.dtype])
                   for _ in range(3))
        calls = {name: (lambda f=table[name]: f(q, k, v, args.causal)) for name in names}
        flops = bench.forward_flops(cfg, n, args.causal)
        for way, seconds in (("blocks, cuDNN first", blocks(calls, names)),
                             ("blocks, fusedattn first", blocks(calls, names[::-1])),
                             ("interleaved", interleaved(calls)),
                             ("blocks, cuDNN first (again)", blocks(calls, names))):
            rate = {name: flops / s / 1e12 for name, s in seconds.items()}
            print(f"| {n} | {way} | {rate['sdpa-cudnn']:.1f} | {rate['fusedattn']:.1f} | "
                  f"{rate['fusedattn'] / rate['sdpa-cudnn']:.3f} |")
