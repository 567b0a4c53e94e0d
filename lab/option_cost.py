"""Lab: what an option costs on the GPU: each call timed with the option and
without it, interleaved per row (bench.interleaved_medians), as the ratio of
the times (issue 31's bars: sinks at most 3%, softcap at most 10%). Forward,
forward+backward and decode (the KV cache, planner's splits).
  python lab/option_cost.py [--options sinks] [--head-dim 128] [--json PATH] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json

import torch

import fusedattn
from fusedattn import bench

DENSE = [(4096, False), (4096, True), (8192, False), (8192, True)]  # (N, is_causal), B=4, H=16 (d=256: 8)
DECODE = [4096, 32768]  # cache lengths, B=8, Hq=32, Hkv=8, d=128, one query


def option_values(name: str, heads: int, device) -> dict:
    if name == "sinks":
        return {"sinks": torch.randn(heads, device=device, requires_grad=True)}
    if name == "softcap":
        return {"softcap": 30.0}
    raise SystemExit(f"option_cost.py: --options takes sinks, softcap; got {name!r}")


def dense_calls(n, is_causal, dtype, backward, options, head_dim, heads):
    q, k, v = (torch.randn(4, heads, n, head_dim, device="cuda", dtype=dtype, requires_grad=backward)
               for _ in range(3))
    grad = torch.randn_like(q)
    if not backward:  # else autograd would record the call with the option and not without it
        options = {key: (v.detach() if torch.is_tensor(v) else v) for key, v in options.items()}

    def call(opts):
        def run():
            out = fusedattn.attention(q, k, v, is_causal=is_causal, **opts)
            if backward:
                out.backward(grad)
        return run
    return call({}), call(options)


def decode_calls(length, dtype, options):
    q = torch.randn(8, 32, 1, 128, device="cuda", dtype=dtype)
    k_cache, v_cache = (torch.randn(8, 8, length, 128, device="cuda", dtype=dtype) for _ in range(2))
    lens = torch.full((8,), length, dtype=torch.int32, device="cuda")
    options = {key: (v.detach() if torch.is_tensor(v) else v) for key, v in options.items()}

    def call(opts):
        return lambda: fusedattn.attention_with_kvcache(q, k_cache, v_cache, lens, **opts)
    return call({}), call(options)


def timed(fn):
    return lambda: bench._time_once(fn, torch.device("cuda"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--options", default="sinks")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--head-dim", type=int, default=128, help="of the dense calls (decode stays at 128)")
    parser.add_argument("--json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for name in args.options.split(","):
        d = args.head_dim
        heads = 8 if d == 256 else 16  # issue 31's bars: H=16, H=8 at d=256
        cases = [(f"forward d={d} N={n}{' causal' if c else ''}",
                  lambda n=n, c=c: dense_calls(n, c, dtype, False, option_values(name, heads, "cuda"), d, heads))
                 for n, c in DENSE]
        # fwd+bwd where a fused backward serves the option (the gemm family is not the point).
        backward = fusedattn.ops.supports(torch.device("cuda"), dtype, d, softcap=name == "softcap", fused=True)
        cases += [(f"fwd+bwd d={d} N={n}{' causal' if c else ''}",
                   lambda n=n, c=c: dense_calls(n, c, dtype, True, option_values(name, heads, "cuda"), d, heads))
                  for n, c in DENSE if backward]
        cases += [(f"decode cache={n}", lambda n=n: decode_calls(n, dtype, option_values(name, 32, "cuda")))
                  for n in DECODE]
        for label, make in cases:
            without, with_option = make()
            for fn in (without, with_option):  # warm-up: compile nothing, but allocate and plan
                fn()
            torch.cuda.synchronize()
            medians = bench.interleaved_medians({"without": timed(without), "with": timed(with_option)},
                                                args.repeats)
            ratio = medians["with"] / medians["without"]
            rows.append({"option": name, "call": label, "without_us": medians["without"] * 1e6,
                         "with_us": medians["with"] * 1e6, "cost": ratio - 1})
            print(f"{name:8s} {label:30s} without {medians['without'] * 1e6:9.1f} us  "
                  f"with {medians['with'] * 1e6:9.1f} us  cost {100 * (ratio - 1):+6.2f}%", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
