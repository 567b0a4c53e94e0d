"""Host time per attention call at a tiny shape, where launching is the cost.

MiniLM on the H200 (examples/minilm_embeddings.py, 2026-11-30) ran 1.2 ms
slower per batch with fusedattn than with SDPA although its six attention
kernels took less GPU time (108 us against 146 us): the batch is bound by the
host. This times each layer of a call, from the Hugging Face attention function
down to the operator, back to back with no synchronisation between calls, and
then profiles the Python of fusedattn's Hugging Face path.

    python lab/call_overhead.py [--device cuda] [--calls 2000]

Shapes default to MiniLM's (batch 64, 12 heads, 18 tokens, head dim 32, a bool
padding mask [B, 1, L, L]).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import fusedattn
import fusedattn.hf

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--calls", type=int, default=2000)
parser.add_argument("--shape", default="64,12,18,32", help="B,H,L,d")
args = parser.parse_args()
B, H, L, d = (int(x) for x in args.shape.split(","))
device = torch.device(args.device)
dtype = torch.float16 if device.type == "cuda" else torch.float32
q, k, v = (torch.randn(B, H, L, d, device=device, dtype=dtype) for _ in range(3))
mask = torch.ones(B, 1, L, L, dtype=torch.bool, device=device)
mask[B // 2:, :, :, L // 2:] = False  # padding in half the batch


class Module:  # what transformers passes as `module`
    is_causal = False


def hf_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(Module, q, k, v, mask, scaling=d ** -0.5)


paths = {
    "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    "torch.ops.fusedattn.forward": lambda: torch.ops.fusedattn.forward(q, k, v, mask, False, None),
    "fusedattn.attention": lambda: fusedattn.attention(q, k, v, attn_mask=mask),
    "transformers sdpa_attention_forward": hf_sdpa,
    "fusedattn.hf.attention_forward": lambda: fusedattn.hf.attention_forward(Module, q, k, v, mask,
                                                                            scaling=d ** -0.5),
}


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


print(f"{device.type}, {dtype}, B={B} H={H} L={L} d={d}, bool mask; {args.calls} calls back to back")
with torch.no_grad():
    rates = {name: per_call_us(fn, args.calls) for name, fn in paths.items()}
    for name, us in rates.items():
        print(f"  {name:38} {us:8.1f} us per call")
    profiled = "fusedattn.hf.attention_forward"
    print(f"\nPython profile of {profiled}, {args.calls // 4} calls (top 15 by own time):")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls // 4):
        paths[profiled]()
    sync()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(15)
