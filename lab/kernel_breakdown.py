"""GPU time of each kernel in one fusedattn call (torch.profiler), to see what
besides the main kernel a call costs.

    python lab/kernel_breakdown.py [--backward] [--shape B,H,N,d] [--causal]
        [--dtype float16] [--calls 10] [--mask KIND] [--block-mask] [--deterministic]

Prints each kernel's total and per-call time over --calls calls (after a
warm-up), largest first, and the sum; with --deterministic under
torch.use_deterministic_algorithms(True).
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import fusedattn
from fusedattn.bench import _deterministic_algorithms
from mask_cases import KINDS_HELP, dense_mask

parser = argparse.ArgumentParser()
parser.add_argument("--shape", default="4,32,2048,64", help="B,H,N,d")
parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
parser.add_argument("--causal", action="store_true")
parser.add_argument("--backward", action="store_true", help="forward + backward, as `fusedattn bench --backward` times")
parser.add_argument("--calls", type=int, default=10)
parser.add_argument("--mask", help="attn_mask: " + KINDS_HELP)
parser.add_argument("--block-mask", action="store_true", help="--mask as a fusedattn.BlockMask (built once)")
parser.add_argument("--deterministic", action="store_true", help="under torch.use_deterministic_algorithms(True)")
args = parser.parse_args()
if not torch.cuda.is_available():
    parser.error("needs a CUDA device")
B, H, N, d = (int(x) for x in args.shape.split(","))
dtype = getattr(torch, args.dtype)
q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype, requires_grad=args.backward) for _ in range(3))
grad = torch.randn(B, H, N, d, device="cuda", dtype=dtype)
mask = None if args.mask is None else dense_mask(args.mask, B, N, "cuda")
if mask is not None and args.block_mask:
    mask = fusedattn.BlockMask.from_dense(mask)


def call():
    out = fusedattn.attention(q, k, v, attn_mask=mask, is_causal=args.causal)
    if args.backward:
        torch.autograd.grad(out, (q, k, v), grad)


with _deterministic_algorithms() if args.deterministic else contextlib.nullcontext():
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            call()
        torch.cuda.synchronize()

kernels = {}
for event in prof.events():
    if event.device_type == torch.autograd.DeviceType.CUDA:
        kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time
total = sum(kernels.values())
print(f"{'backward' if args.backward else 'forward'} B={B} H={H} N={N} d={d} {args.dtype} "
      f"causal={args.causal} mask={args.mask}{' (BlockMask)' if args.block_mask else ''}"
      f"{' deterministic' if args.deterministic else ''}: GPU time per call, {args.calls} calls")
for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
    print(f"  {us / args.calls:9.1f} us  {100 * us / total:5.1f}%  {name[:110]}")
print(f"  {total / args.calls:9.1f} us  total")
