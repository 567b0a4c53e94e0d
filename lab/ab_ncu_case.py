"""One fusedattn.attention call per shape for Nsight Compute, after warm-up
calls, through the API every version since 7654120 has: lab/ab_bench.sh's
ncu mode runs it under each version and reads the forward kernel's time.

    python3 lab/ab_ncu_case.py d=128,N=8192,causal=1,dtype=bfloat16 [more shapes]

Each shape: d, N (queries and keys), B (4), H (32), causal (0/1), dtype
(float16/bfloat16); a shape's calls are warm-up calls then `--calls` profiled
ones (3), so ncu's --launch-skip is the warm-up count times the shapes before.
"""

import argparse

import torch

import fusedattn

parser = argparse.ArgumentParser()
parser.add_argument("shapes", nargs="+", help="d=..,N=..[,B=..,H=..,causal=0|1,dtype=..]")
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--calls", type=int, default=3)
args = parser.parse_args()

for spec in args.shapes:
    s = {"B": "4", "H": "32", "causal": "0", "dtype": "float16"}
    s.update(kv.split("=", 1) for kv in spec.split(","))
    dtype = getattr(torch, s["dtype"])
    shape = (int(s["B"]), int(s["H"]), int(s["N"]), int(s["d"]))
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    for _ in range(args.warmup + args.calls):
        fusedattn.attention(q, k, v, is_causal=s["causal"] == "1")
    torch.cuda.synchronize()
