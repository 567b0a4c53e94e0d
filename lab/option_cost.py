"""Lab: what an option costs: each call timed with the option and without it,
interleaved per row (bench.interleaved_medians), as the ratio of the times
(issue 31's bars: sinks at most 3%, softcap at most 10%). Forward,
forward+backward and decode (the KV cache, planner's splits); on the CPU at
smaller shapes (B=1, H=8, N=1K, d=64 unless --head-dim).
  python lab/option_cost.py [--options sinks] [--head-dim 128] [--device cpu] [--json PATH] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

import fusedattn
from fusedattn import bench


# Per device: the dense calls' batch, heads (at d=256 on CUDA: 8, issue 31's bar), head dim and
# (N, is_causal) rows; the decode calls' cache lengths (B=8, Hq=32, Hkv=8, d=128, one query).
SHAPES = {
    "cuda": {"batch": 4, "heads": 16, "head_dim": 128,
             "dense": [(4096, False), (4096, True), (8192, False), (8192, True)], "decode": [4096, 32768]},
    "cpu": {"batch": 1, "heads": 8, "head_dim": 64, "dense": [(1024, False), (1024, True)], "decode": [4096]},
}


def option_values(name: str, heads: int, device) -> dict:
    if name == "sinks":
        return {"sinks": torch.randn(heads, device=device, requires_grad=True)}
    if name == "softcap":
        return {"softcap": 30.0}
    raise SystemExit(f"option_cost.py: --options takes sinks, softcap; got {name!r}")


def dense_calls(n, is_causal, dtype, backward, options, shape, device):
    b, h, d = shape
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=backward) for _ in range(3))
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


def decode_calls(length, dtype, options, device):
    q = torch.randn(8, 32, 1, 128, device=device, dtype=dtype)
    k_cache, v_cache = (torch.randn(8, 8, length, 128, device=device, dtype=dtype) for _ in range(2))
    lens = torch.full((8,), length, dtype=torch.int32, device=device)
    options = {key: (v.detach() if torch.is_tensor(v) else v) for key, v in options.items()}

    def call(opts):
        return lambda: fusedattn.attention_with_kvcache(q, k_cache, v_cache, lens, **opts)
    return call({}), call(options)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name()
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor() or "cpu")
    return f"{model}, {torch.get_num_threads()} threads"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--options", default="sinks")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--head-dim", type=int, help="of the dense calls (decode stays at 128)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--json")
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    shapes = SHAPES[device.type]
    d = args.head_dim or shapes["head_dim"]
    heads = 8 if d == 256 and device.type == "cuda" else shapes["heads"]
    shape = (shapes["batch"], heads, d)
    timed = lambda fn: lambda: bench._time_once(fn, device)  # noqa: E731
    rows = []
    for name in args.options.split(","):
        cases = [(f"forward d={d} N={n}{' causal' if c else ''}",
                  lambda n=n, c=c: dense_calls(n, c, dtype, False, option_values(name, heads, device), shape, device))
                 for n, c in shapes["dense"]]
        # fwd+bwd where a fused backward serves the option (the gemm family is not the point).
        backward = fusedattn.ops.supports(device, dtype, d, softcap=name == "softcap", fused=True)
        cases += [(f"fwd+bwd d={d} N={n}{' causal' if c else ''}",
                   lambda n=n, c=c: dense_calls(n, c, dtype, True, option_values(name, heads, device), shape, device))
                  for n, c in shapes["dense"] if backward]
        cases += [(f"decode cache={n}", lambda n=n: decode_calls(n, dtype, option_values(name, 32, device), device))
                  for n in shapes["decode"]]
        for label, make in cases:
            without, with_option = make()
            for fn in (without, with_option):  # warm-up: compile nothing, but allocate and plan
                fn()
            if device.type == "cuda":
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
            json.dump({"device": device_name(device), "dtype": args.dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
