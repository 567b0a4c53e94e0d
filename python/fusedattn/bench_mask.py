"""`fusedattn bench --mask KIND`: masked attention, TFLOP/s over the visible score entries.

Per mask kind and N: fusedattn given the mask as a BlockMask and as a dense
bool mask (and, for windows, as `window=`), FlexAttention compiled with its
BlockMask, and SDPA with the dense mask, interleaved per row
(bench.interleaved_medians); also the BlockMask's build time. Every method
counts the same FLOPs: 4 H d per visible (b, i, j) entry (x 3.5 with the
backward), counted exactly from the dense mask.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

import fusedattn

from . import bench, blockmask

KINDS = ("window", "docs", "keypad", "causal_keypad", "random")
RANDOM_BLOCK = 128  # random:P hides whole RANDOM_BLOCK x RANDOM_BLOCK blocks of the score matrix
RANDOM_SEED = 0
KEYPAD_FRACTIONS = (1, 1 / 2, 1 / 4, 3 / 4)  # key length of batch item b: N * KEYPAD_FRACTIONS[b % 4]
BUILD_REPEATS = 5  # BlockMask builds per row (the median is reported)


@dataclasses.dataclass(frozen=True)
class MaskKind:
    name: str  # one of KINDS
    param: int | float | None = None  # W (window), K (docs), P (random); None for the key-padding kinds

    def __str__(self) -> str:
        return self.name if self.param is None else f"{self.name}:{self.param}"


# The parameter of each kind that takes one: its letter, what it is, and whether a value is in range.
_PARAMS = {"window": ("W", "keys left of the query, an integer >= 0", int, lambda w: w >= 0),
           "docs": ("K", "documents, an integer >= 1", int, lambda k: k >= 1),
           "random": ("P", "the share of hidden blocks, in [0, 1)", float, lambda p: 0 <= p < 1)}


def parse_kinds(specs: list[str]) -> list[MaskKind]:
    """The kinds of --mask (each spec comma-separated, and --mask may be repeated).
    Raises ValueError saying which one is wrong and why."""
    kinds = []
    for text in (t.strip() for spec in specs for t in spec.split(",")):
        name, colon, value = text.partition(":")
        if name not in KINDS:
            raise ValueError(f"unknown kind {text!r}; choose from window:W, docs:K, keypad, causal_keypad, random:P")
        if name not in _PARAMS:
            if colon:
                raise ValueError(f"{text!r}: {name} takes no parameter")
            kinds.append(MaskKind(name))
            continue
        letter, what, parse, in_range = _PARAMS[name]
        try:
            param = parse(value)
        except ValueError:
            raise ValueError(f"{text!r}: give {name}:{letter}, {letter} the {what}") from None
        if not in_range(param):
            raise ValueError(f"{text!r}: {letter} out of range ({letter}: the {what})")
        kinds.append(MaskKind(name, param))
    return list(dict.fromkeys(kinds))  # a kind given twice is timed once


def seqlen_problem(kinds: list[MaskKind], seqlens: list[int]) -> str | None:
    """Why a kind cannot be laid over one of the lengths (docs:K needs N >= K), or None."""
    for kind in kinds:
        if kind.name == "docs" and min(seqlens) < kind.param:
            return f"--mask {kind}: {kind.param} documents need every N >= {kind.param}, got {min(seqlens)}"
    return None


def _random_blocks(n: int, p: float, device) -> torch.Tensor:
    """Visible blocks of random:P, [ceil(n / RANDOM_BLOCK)] ** 2 bool, the same for a given (n, p)."""
    blocks = -(-n // RANDOM_BLOCK)
    g = torch.Generator().manual_seed(RANDOM_SEED)
    return (torch.rand(blocks, blocks, generator=g) >= p).to(device)


def keypad_lengths(batch: int, n: int, device) -> torch.Tensor:
    return torch.tensor([int(n * KEYPAD_FRACTIONS[b % 4]) for b in range(batch)], device=device)


def mask_mod(kind: MaskKind, batch: int, n: int, device) -> tuple[Callable, bool]:
    """(mask_mod(b, h, q_idx, kv_idx) -> bool, per_batch): FlexAttention's
    predicate of the kind over index tensors; per_batch: it reads b (else B=None)."""
    if kind.name == "window":
        return (lambda b, h, q, kv: (kv <= q) & (q - kv <= kind.param)), False
    if kind.name == "docs":
        length, last = n // kind.param, kind.param - 1  # the last document takes the remainder
        doc = lambda i: torch.clamp(i // length, max=last)  # noqa: E731
        return (lambda b, h, q, kv: (doc(q) == doc(kv)) & (kv <= q)), False
    if kind.name == "random":
        blocks = _random_blocks(n, kind.param, device)
        return (lambda b, h, q, kv: blocks[q // RANDOM_BLOCK, kv // RANDOM_BLOCK]), False
    lengths = keypad_lengths(batch, n, device)
    if kind.name == "keypad":
        return (lambda b, h, q, kv: kv < lengths[b]), True
    return (lambda b, h, q, kv: (kv < lengths[b]) & (kv <= q)), True


def dense_mask(mod: Callable, batch: int, n: int, device) -> torch.Tensor:
    """mod over the [B, 1, N, N] index grid, in the broadcast shape of the
    indices it reads (fusedattn.block_mask's evaluation): [B, 1, 1, N] for
    keypad, [B, 1, N, N] for causal_keypad, [1, 1, N, N] for the kinds the same
    in every batch item."""
    return blockmask.block_mask(mod, batch, None, n, n, device=device).to_dense()


def visible_entries(mask: torch.Tensor, batch: int, n: int) -> int:
    """Visible (b, i, j) entries of a 4-D `mask` broadcast to [B, 1, N, N],
    exactly, without materialising it: each broadcast dimension multiplies the count."""
    count = int(mask.sum())
    for size, full in zip(mask.shape, (batch, 1, n, n)):
        count *= full // size
    return count


def _flex(mod: Callable, per_batch: bool, batch: int, n: int, device) -> Callable:
    """f(q, k, v, causal): torch.compile(flex_attention) with create_block_mask of mod;
    raises NotImplementedError where it cannot run (bench._prepare reports n/a)."""
    if device.type != "cuda":
        raise NotImplementedError("FlexAttention is timed on CUDA only")
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        raise NotImplementedError(f"torch {torch.__version__} has no flex_attention") from None
    # Each row compiles afresh: past dynamo's recompile limit (a new mask_mod each row) or with the
    # dynamic shapes it turns to after a second N, flex_attention would run slower, unseen.
    torch._dynamo.reset()
    block_mask = create_block_mask(mod, batch if per_batch else None, None, n, n, device=device)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v, causal: compiled(q, k, v, block_mask=block_mask)


def _synchronised_seconds(fn: Callable, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def methods(kind: MaskKind, mod: Callable, per_batch: bool, dense: torch.Tensor, batch: int, n: int,
            device) -> tuple[dict[str, Callable], dict]:
    """(name -> f(q, k, v, causal) as bench._prepare takes it, build): the
    columns of one row, and the BlockMask's median build time in ms (or why
    there is none). A column that cannot run raises NotImplementedError when
    it is called (bench._prepare reports it as n/a)."""
    def refuses(why: str) -> Callable:
        def call(q, k, v, causal):
            raise NotImplementedError(why)
        return call

    table = {}
    make = lambda: fusedattn.block_mask(mod, batch if per_batch else None, None, n, n, device=device)  # noqa: E731
    try:
        block_mask = make()  # also the warm-up of the timed builds
        build = {"status": "ok", "ms": 1e3 * statistics.median(
            _synchronised_seconds(make, device) for _ in range(BUILD_REPEATS))}
        table["fusedattn-blockmask"] = lambda q, k, v, causal: fusedattn.attention(q, k, v, attn_mask=block_mask)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        build = bench.not_available(e)
        table["fusedattn-blockmask"] = refuses(str(e))
    table["fusedattn-dense"] = lambda q, k, v, causal: fusedattn.attention(q, k, v, attn_mask=dense)
    if kind.name == "window":
        table["fusedattn-window"] = lambda q, k, v, causal: fusedattn.attention(q, k, v, window=(kind.param, 0))
    try:
        table["flex"] = _flex(mod, per_batch, batch, n, device)
    except NotImplementedError as e:
        table["flex"] = refuses(str(e))
    table["sdpa"] = lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    return table, build


@dataclasses.dataclass
class MaskConfig:
    """What `fusedattn bench --mask` times; bench._inputs and bench._prepare
    read its fields as they read a bench.Config's, cli._apply_options sets them."""
    device: torch.device
    kinds: list[MaskKind]
    batch: int
    heads: int
    head_dim: int
    seqlens: list[int]
    dtypes: list[str]  # one (the command line refuses more): its name in bench.DTYPES
    repeats: int
    warmup: int
    backward: bool = False  # time forward + backward


def default_config(device: torch.device, kinds: list[MaskKind]) -> MaskConfig:
    if device.type == "cuda":
        return MaskConfig(device, kinds, 4, 16, 128, [4096, 8192, 16384], ["bfloat16"], repeats=10, warmup=3)
    return MaskConfig(device, kinds, 4, 4, 64, [512, 1024], ["float32"], repeats=3, warmup=1)


def measure_row(cfg: MaskConfig, kind: MaskKind, n: int) -> dict:
    """One row: per column its median time, rate over the visible entries and
    peak memory, or why it did not run; the build time; each fusedattn
    column's rate over flex's. The columns' timed calls interleave."""
    try:
        mod, per_batch = mask_mod(kind, cfg.batch, n, cfg.device)
        dense = dense_mask(mod, cfg.batch, n, cfg.device)
        visible = visible_entries(dense, cfg.batch, n)
        table, build = methods(kind, mod, per_batch, dense, cfg.batch, n, cfg.device)
        inputs = bench._inputs(cfg, cfg.dtypes[0], n)
        results, timed = {}, {}
        for name, fn in table.items():
            timed[name], results[name] = bench._prepare(cfg, inputs, False, name, fn)
        medians = bench.interleaved_medians({m: t for m, t in timed.items() if t is not None}, cfg.repeats)
    finally:
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
    flops = 4.0 * cfg.heads * cfg.head_dim * visible * (1 + bench.BACKWARD_FLOP_RATIO if cfg.backward else 1)
    for name, seconds in medians.items():
        if isinstance(seconds, dict):
            results[name] = seconds
        else:
            results[name].update(seconds=seconds, tflops=flops / seconds / 1e12)
    flex = results["flex"]
    over_flex = {m: flex["seconds"] / r["seconds"] for m, r in results.items()
                 if m.startswith("fusedattn") and r["status"] == "ok" and flex["status"] == "ok"}
    return {"mask": str(kind), "seqlen": n, "backward": cfg.backward, "visible_entries": visible,
            "visible_fraction": visible / (cfg.batch * n * n), "build": build, "results": results,
            "over_flex": over_flex}


def run(cfg: MaskConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    problem = seqlen_problem(cfg.kinds, cfg.seqlens)  # the command line checks it first
    if problem:
        raise ValueError(f"fusedattn bench {problem}")
    keys = [(kind, n) for kind in cfg.kinds for n in cfg.seqlens]
    rows = [measure_row(cfg, kind, n)
            for kind, n in tqdm(keys, desc="fusedattn bench --mask", disable=not progress, unit="row")]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": bench.describe_device(cfg.device),
        "device_type": cfg.device.type,
        "torch": torch.__version__,
        "config": {"mask": [str(k) for k in cfg.kinds], "batch": cfg.batch, "heads": cfg.heads,
                   "head_dim": cfg.head_dim, "dtype": cfg.dtypes[0], "repeats": cfg.repeats,
                   "backward": cfg.backward},
        "methods": list(dict.fromkeys(m for row in rows for m in row["results"])),
        "rows": rows,
    }


def is_mask(result: dict) -> bool:
    """Whether a saved result is `fusedattn bench --mask`'s."""
    return "mask" in result["config"]


def format_table(result: dict) -> str:
    """One markdown table per kind: N, the visible share, the BlockMask's build
    time, each column's rate, and each fusedattn column's rate over flex's."""
    cfg = result["config"]
    unit, mult = bench._rate_unit(result)
    what = "forward + backward (FLOPs: 3.5x the forward)" if cfg["backward"] else "forward"
    title = bench.run_line(result) + "\n" + bench._wrap(
        f"masks, {what}, B={cfg['batch']} H={cfg['heads']} d={cfg['head_dim']} {cfg['dtype']}, median of "
        f"{cfg['repeats']} calls per cell; each column's {unit} over the visible score entries (blockmask, dense, "
        f"window: fusedattn given the mask as a BlockMask, a dense bool mask, window=); build: the BlockMask's "
        f"median build time; x/flex = rate of x / rate of FlexAttention (> 1: fusedattn is faster)")
    tables = []
    for kind in cfg["mask"]:
        rows = [row for row in result["rows"] if row["mask"] == kind]
        names = [m for m in result["methods"] if m in rows[0]["results"]]
        fused = [m for m in names if m.startswith("fusedattn")]
        label = lambda m: m.removeprefix("fusedattn-")  # noqa: E731
        header = ["N", "visible", "build ms"] + [label(m) for m in names] + [f"{label(m)}/flex" for m in fused]
        lines = [[str(row["seqlen"]), f"{100 * row['visible_fraction']:.1f}%",
                  bench.cell(row["build"], lambda r: bench.fmt3(r["ms"]))]
                 + [bench.cell(row["results"][m], lambda r: bench.fmt3(r["tflops"] * mult)) for m in names]
                 + [bench.fmt_ratio(row["over_flex"][m]) if m in row["over_flex"] else "-" for m in fused]
                 for row in rows]
        tables.append(f"mask {kind}:\n" + bench.markdown_table(header, lines))
    return title + "\n\n" + "\n\n".join(tables)
