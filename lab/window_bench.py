"""Lab: sliding-window attention on the GPU, fusedattn's banded kernels against
FlexAttention (compiled, its sliding-window BlockMask) and fusedattn's own
dense causal rate at the same N, forward and forward+backward, TFLOP/s over
the visible score entries, methods interleaved per row (bench.interleaved_medians).
`fusedattn bench --mask window:W` times windows against FlexAttention too; this adds
the rate against fusedattn's own dense causal kernel (the 0.85x bar).
  python lab/window_bench.py [--json PATH] [--dtypes bfloat16,float16] [--head-dims 64,128]
"""

from __future__ import annotations

import argparse
import json

import torch

import fusedattn
from fusedattn import bench

ROWS = [(16384, 1024), (32768, 4096), (8192, 1024), (4096, 512)]  # (N, left window), causal


def visible_entries(n: int, left: int) -> int:
    """Score entries with 0 <= i - j <= left for i, j in [0, n)."""
    full = min(left, n - 1)
    return (full + 1) * n - full * (full + 1) // 2


def flex_window(q, k, v, left):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask_mod(b, h, qi, kj):
        return (qi >= kj) & (qi - kj <= left)

    block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device=q.device)
    compiled = torch.compile(flex_attention)
    return lambda: compiled(q, k, v, block_mask=block_mask)


def timed(fn, backward: bool, inputs):
    if not backward:
        return fn
    out = fn()
    grad = torch.randn_like(out)

    def step():
        for t in inputs:
            t.grad = None
        fn().backward(grad)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    B, H = 4, 16
    results = []
    for dtype_name in args.dtypes.split(","):
        dtype = bench.DTYPES[dtype_name]
        for d in map(int, args.head_dims.split(",")):
            for n, left in ROWS:
                for backward in (False, True):
                    q, k, v = (torch.randn(B, H, n, d, device="cuda", dtype=dtype, requires_grad=backward)
                               for _ in range(3))
                    methods = {
                        "fusedattn": lambda: fusedattn.attention(q, k, v, window=(left, 0)),
                        "flex": flex_window(q, k, v, left),
                        "fusedattn-causal": lambda: fusedattn.attention(q, k, v, is_causal=True),
                    }
                    fns = {name: timed(fn, backward, (q, k, v)) for name, fn in methods.items()}
                    for fn in fns.values():  # warm-up and compile
                        for _ in range(3):
                            fn()
                    torch.cuda.synchronize()
                    seconds = bench.interleaved_medians(
                        {name: (lambda f=fn: bench._time_once(f, q.device)) for name, fn in fns.items()},
                        args.repeats)
                    factor = 1 + (bench.BACKWARD_FLOP_RATIO if backward else 0)
                    flops = {"fusedattn": visible_entries(n, left), "flex": visible_entries(n, left),
                             "fusedattn-causal": visible_entries(n, n)}
                    row = {"dtype": dtype_name, "head_dim": d, "n": n, "window": left, "backward": backward}
                    for name, s in seconds.items():
                        row[name] = 4 * B * H * d * flops[name] * factor / s / 1e12
                    row["x_flex"] = row["fusedattn"] / row["flex"]
                    row["x_causal"] = row["fusedattn"] / row["fusedattn-causal"]
                    results.append(row)
                    print(f"{dtype_name} d={d} N={n} window={left} {'fwd+bwd' if backward else 'fwd'}: "
                          f"fusedattn {row['fusedattn']:.0f}  flex {row['flex']:.0f}  "
                          f"causal {row['fusedattn-causal']:.0f} TFLOP/s  x flex {row['x_flex']:.2f}  "
                          f"x causal {row['x_causal']:.2f}", flush=True)
                    del q, k, v, fns, methods
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
