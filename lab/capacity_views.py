"""A decoding step over N keys in three caches: a cache of N positions, a
cache of C positions holding N, and a view of that cache narrowed to its
first N positions (the README's advice for caches far longer than their
lengths). The host's split rule sees N, C and N: this measures whether the
narrowed view, whose heads lie C positions apart, reads as the cache of N.
`fusedattn bench --decode`'s timing (bench_decode.QueuedTiming) and bytes
(the valid K and V), B=8, Hq=32, d=128, float16, every sequence at N.

    python lab/capacity_views.py [--capacity 131072] [--seqlens 4096,32768] [--kv-heads 32,8]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from fusedattn import bench_decode

parser = argparse.ArgumentParser()
parser.add_argument("--capacity", type=int, default=131072)
parser.add_argument("--seqlens", default="4096,32768")
parser.add_argument("--kv-heads", default="32,8", dest="kv_heads")
parser.add_argument("--repeats", type=int, default=10)
args = parser.parse_args()

device = torch.device("cuda")
B, HQ, D = 8, 32, 128
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; TB/s of the valid K and V, "
      f"median of {args.repeats} intervals of {bench_decode.CALLS_PER_TIMING} queued calls\n")
print(f"| Hkv | N | cache of N | cache of {args.capacity} | view of N |")
print("|---|---|---|---|---|")
for hkv in (int(h) for h in args.kv_heads.split(",")):
    for n in (int(x) for x in args.seqlens.split(",")):
        if n > args.capacity:
            raise SystemExit(f"capacity_views: N={n} exceeds --capacity {args.capacity}")
        q = torch.randn(B, HQ, 1, D, device=device, dtype=torch.float16)
        lengths = torch.full((B,), n, dtype=torch.int32, device=device)
        exact = [torch.randn(B, hkv, n, D, device=device, dtype=torch.float16) for _ in range(2)]
        long = [torch.randn(B, hkv, args.capacity, D, device=device, dtype=torch.float16) for _ in range(2)]
        views = [c[:, :, :n] for c in long]
        bytes_read = 2 * B * hkv * n * D * 2
        cells = []
        for k, v in (exact, long, views):
            def calls(k=k, v=v):
                for _ in range(bench_decode.CALLS_PER_TIMING):
                    torch.ops.fusedattn.forward_kvcache(q, k, v, lengths, None, None, True, None)

            calls()
            timer = bench_decode.QueuedTiming(calls, device)
            seconds = statistics.median(timer() for _ in range(args.repeats))
            cells.append(f"{bytes_read / seconds / 1e12:.2f}")
        print(f"| {hkv} | {n} | " + " | ".join(cells) + " |")
        del exact, long, views
        torch.cuda.empty_cache()
