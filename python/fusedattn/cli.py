"""The `fusedattn` command line (also `python -m fusedattn`)."""

from __future__ import annotations

import argparse
import sys

import torch


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _bench(args) -> int:
    from . import bench

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = bench.default_config(device)
    for field in ("batch", "heads", "head_dim", "seqlens", "repeats", "warmup"):
        if getattr(args, field) is not None:
            setattr(cfg, field, getattr(args, field))
    if args.dtype:
        unknown = [d for d in args.dtype.split(",") if d not in bench.DTYPES]
        if unknown:
            raise SystemExit(f"fusedattn bench: unknown dtype {unknown}; choose from {list(bench.DTYPES)}")
        cfg.dtypes = args.dtype.split(",")
    if args.causal is not None:
        cfg.causal = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]

    result = bench.run(cfg, progress=not args.no_progress)
    print(bench.format_table(result))
    if args.json:
        bench.save_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        bench.plot(result, args.plot)
        print(f"wrote {args.plot}")
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
    b.add_argument("--warmup", type=int)
    b.add_argument("--json", metavar="PATH", help="write the results as JSON")
    b.add_argument("--plot", metavar="PATH.png", help="plot time and memory against N (needs matplotlib)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    import fusedattn  # noqa: F401  (loads the operators)

    return {"bench": _bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
