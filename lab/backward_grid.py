"""GPU time of the backward's key-block kernel over a grid of shapes, one line
per shape, to compare kernel builds where `fusedattn bench --backward` (which
times the forward too) would dilute the difference.

    python lab/backward_grid.py [--tag NAME] [--dtype bfloat16] [--kernel sm90_backward_kernel] [--masks none,keypad]
        [--modes default,deterministic]

For each shape: 3 warm-up calls of torch.ops.fusedattn.backward, then three
profiles of 10 calls; prints the median per-call time of the kernels whose name
holds --kernel and of all the call's kernels, and the backward's TFLOP/s (2.5x
the forward's FLOPs, halved under causal) over the latter. --modes deterministic
times each shape under torch.use_deterministic_algorithms(True) too (its own
kernels on sm90: dQ added at turns), a line per mode.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

import fusedattn  # noqa: F401  (registers the operators)
from fusedattn.bench import _deterministic_algorithms
from fusedattn.bench_mask import keypad_lengths

SHAPES = [(4, 16, 8192, 128), (4, 32, 2048, 128), (4, 16, 8192, 64), (4, 32, 2048, 64)]  # B, H, N, d

parser = argparse.ArgumentParser()
parser.add_argument("--tag", default="", help="a name printed first on every line (the build's)")
parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
parser.add_argument("--kernel", default="sm90_backward_kernel", help="the key-block kernel's name, or part of it")
parser.add_argument("--masks", default="none",
                    help="comma-separated: none, keypad (bench --mask keypad's key lengths as a bool [B, 1, 1, N] "
                         "mask: the attn_mask kernels)")
parser.add_argument("--modes", default="default",
                    help="comma-separated: default, deterministic (torch.use_deterministic_algorithms(True))")
args = parser.parse_args()
if not torch.cuda.is_available():
    parser.error("needs a CUDA device")
dtype = getattr(torch, args.dtype)
masks, modes = args.masks.split(","), args.modes.split(",")
if unknown := set(masks) - {"none", "keypad"}:
    parser.error(f"--masks: unknown {sorted(unknown)}; expected none and/or keypad")
if unknown := set(modes) - {"default", "deterministic"}:
    parser.error(f"--modes: unknown {sorted(unknown)}; expected default and/or deterministic")


def key_padding(B: int, N: int) -> torch.Tensor:
    keep = keypad_lengths(B, N, "cuda")
    return (torch.arange(N, device="cuda") < keep[:, None]).view(B, 1, 1, N)


def gpu_us(call, name_part: str) -> tuple[float, float]:
    """Median over three profiles of (matching kernels, all kernels) per call, in us."""
    samples = []
    for _ in range(3):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        samples.append((sum(e.device_time for e in events if name_part in e.name) / 10,
                        sum(e.device_time for e in events) / 10))
    return sorted(s[0] for s in samples)[1], sorted(s[1] for s in samples)[1]


for B, H, N, d in SHAPES:
    for causal in (False, True):
        for mask_name in masks:
            q, k, v, grad = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(4))
            mask = key_padding(B, N) if mask_name == "keypad" else None
            out, lse = torch.ops.fusedattn.forward(q, k, v, mask, causal)

            def call():
                torch.ops.fusedattn.backward(grad, q, k, v, out, lse, mask, causal)

            for mode in modes:
                with _deterministic_algorithms() if mode == "deterministic" else contextlib.nullcontext():
                    for _ in range(3):
                        call()
                    torch.cuda.synchronize()
                    kernel_us, total_us = gpu_us(call, args.kernel)
                if kernel_us == 0.0:  # e.g. the deterministic mode with a mask: sm80's kernels
                    print(f"backward_grid: no kernel named *{args.kernel}* ran at d={d} N={N} mask={mask_name} "
                          f"mode={mode}; pass --kernel", file=sys.stderr, flush=True)
                flops = 2.5 * 4 * B * H * N * N * d * (0.5 if causal else 1.0)  # of the unmasked call
                print(f"{args.tag} d={d} N={N} B={B} H={H} causal={int(causal)} mask={mask_name} mode={mode} "
                      f"kernel_us={kernel_us:.1f} total_us={total_us:.1f} TFLOP/s={flops / total_us / 1e6:.1f}",
                      flush=True)
