"""Fabricated bench results shaped like `fusedattn bench --json` on a GPU, for
tests of the table and the plot that must cover the GPU layout on the CPU.
The numbers are made up (plausible, not measured)."""

from __future__ import annotations

GPU_METHODS = ["naive", "sdpa", "naive-cuda", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "fusedattn-sm80",
               "fusedattn"]
# Time of each method over fusedattn's, and from which N it runs out of memory.
_RATIOS = {"naive": (14.0, 16384), "sdpa": (1.02, None), "naive-cuda": (7.5, 16384), "sdpa-flash": (1.45, None),
           "sdpa-efficient": (2.1, None), "sdpa-cudnn": (0.97, None), "fusedattn-sm80": (1.38, None),
           "fusedattn-deterministic": (1.22, None), "fusedattn": (1.0, None)}


def gpu_result(backward: bool = False, head_dim: int = 128, seqlens=(1024, 2048, 4096, 8192, 16384, 32768),
               dtypes=("float16",)) -> dict:
    methods = GPU_METHODS[:-1] + (["fusedattn-deterministic"] if backward else []) + ["fusedattn"]
    batch, heads = 4, 32
    rows = []
    for dtype in dtypes:
        for causal in (False, True):
            for n in seqlens:
                flops = 4.0 * batch * heads * n * n * head_dim / (2 if causal else 1) * (3.5 if backward else 1)
                rate = (520 if head_dim == 128 else 410) * (0.6 if causal else 0.75) * (1 + 0.3 * (n >= 4096))
                fused = flops / (rate * 1e12)
                results = {}
                for m in methods:
                    ratio, oom_from = _RATIOS[m]
                    ratio *= 1 + 0.04 * (seqlens.index(n) - 2) * (m != "fusedattn")
                    if oom_from is not None and n >= oom_from:
                        results[m] = {"status": "OOM"}
                    elif backward and m == "naive-cuda":
                        results[m] = {"status": "n/a (forward only)"}
                    else:
                        seconds = fused * ratio
                        peak = (3 * batch * heads * n * n * 2 if m.startswith("naive")
                                else batch * heads * n * (head_dim * 2 + 4) * (4 if backward else 1))
                        results[m] = {"status": "ok", "peak_bytes": peak, "seconds": seconds,
                                      "tflops": flops / seconds / 1e12}
                speedup = {m: r["seconds"] / results["fusedattn"]["seconds"] for m, r in results.items()
                           if m != "fusedattn" and r["status"] == "ok"}
                rows.append({"dtype": dtype, "causal": causal, "seqlen": n, "results": results,
                             "arithmetic_intensity": flops / (4.0 * batch * heads * n * head_dim * 2),
                             "fusedattn_pct_of_matmul": 100 * results["fusedattn"]["tflops"] / 780,
                             "fusedattn_speedup": speedup})
    return {"date": "2026-01-01T00:00:00+00:00", "device": "NVIDIA GPU (fabricated)", "device_type": "cuda",
            "torch": "2.13.0", "config": {"batch": batch, "heads": heads, "head_dim": head_dim, "repeats": 10,
                                          "threads": 16, "backward": backward},
            "methods": methods, "matmul_tflops": {d: 780.0 for d in dtypes},
            "matmul_dtype": {d: d for d in dtypes}, "rows": rows}


def decode_result(seqlens=(4096, 32768, 131072)) -> dict:
    methods = ["sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "fusedattn"]
    rows = []
    for varlen in (False, True):
        for n in seqlens:
            useful = 2 * 8 * n * 32 * 128 * 2 // (2 if varlen else 1)
            fused = useful / 4.2e12
            results = {}
            for m, ratio in zip(methods, (1.3, 1.9, 1.1, 1.0)):
                if varlen and m != "fusedattn":
                    results[m] = {"status": "n/a (no per-sequence lengths)"}
                else:
                    results[m] = {"status": "ok", "seconds": fused * ratio, "kv_bytes": useful,
                                  "tb_per_s": useful / (fused * ratio) / 1e12, "short_sleeps": 0}
            rows.append({"dtype": "float16", "varlen": varlen, "seqlen": n, "results": results,
                         "fusedattn_speedup": {m: r["seconds"] / fused for m, r in results.items()
                                               if m != "fusedattn" and r["status"] == "ok"}})
    return {"date": "2026-01-01T00:00:00+00:00", "device": "NVIDIA GPU (fabricated)", "torch": "2.13.0",
            "config": {"batch": 8, "heads": 32, "kv_heads": 32, "head_dim": 128, "repeats": 10,
                       "launch_gaps": False, "capacity": None}, "methods": methods, "rows": rows}
