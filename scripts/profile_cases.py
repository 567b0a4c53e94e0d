"""One forward and one backward call of fusedattn for a profiler, after a
warm-up: B=4, H=32, d=128, N=4096, float16 (the seed table's middle), causal
with --causal. Run under ncu, e.g. scripts/gpu_check.sh's profile stage."""

import argparse

import torch

import fusedattn  # noqa: F401  (registers the operators)

parser = argparse.ArgumentParser()
parser.add_argument("--causal", action="store_true")
parser.add_argument("--seqlen", type=int, default=4096)
parser.add_argument("--head-dim", type=int, default=128)
args = parser.parse_args()

shape = (4, 32, args.seqlen, args.head_dim)
q, k, v, grad = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(4))
# A warm-up pair, then the profiled pair (gpu_check.sh skips the first two launches).
for _ in range(2):
    out, lse = torch.ops.fusedattn.forward(q, k, v, None, args.causal, None)
    torch.ops.fusedattn.backward(grad, q, k, v, out, lse, None, args.causal, None)
torch.cuda.synchronize()
