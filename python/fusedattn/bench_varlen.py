"""`fusedattn bench --varlen MIX`: packed batches of sequences of different
lengths, causal per sequence, TFLOP/s over the visible score entries; and
serving steps (STEPS): one packed call of decodes and prefills against KV
caches, timed against a decode step and a prefill of the same sizes.

Per mix: fusedattn.attention_varlen on the packed batch, fusedattn.attention
on the batch padded to its longest sequence with a key-padding mask,
FlexAttention compiled with a document mask over the packed batch, SDPA on
jagged nested tensors, and, as the yardstick of the schedule, fusedattn's
dense causal kernel on as many sequences of the mix's root-mean-square length
as hold its tokens (the same kind of work with one length). Interleaved per
row (bench.interleaved_medians). Every column counts the same FLOPs: 4 H d per
visible (query, key) pair of the mix (x 3.5 with the backward); the dense
column counts its own.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import random
from typing import Callable

import torch
import torch.nn.functional as F

import fusedattn

from . import bench

# Named mixes of 32K tokens: one long document and shorter ones, and only short ones.
MIXES = {
    "mixed32k": [8192] + [4096] * 2 + [2048] * 4 + [1024] * 4 + [512] * 8,
    "short32k": [512] * 32 + [256] * 64,
}
SHUFFLE_SEED = 0  # the sequences of a mix are packed in an order shuffled with it
# Named serving steps: `decodes` sequences decoding one token at `context`
# cached positions, beside prompts of `prefills` tokens entering empty caches.
STEPS = {"step32x4k+2x512": {"decodes": 32, "context": 4096, "prefills": [512, 512]}}


def parse_mixes(specs: list[str]) -> list[tuple[str, list[int]]]:
    """(name, lengths) of each --varlen spec: a named mix or comma-separated lengths
    (NxL repeats L N times). Raises ValueError saying which one is wrong and why."""
    mixes = []
    for spec in specs:
        if spec in MIXES or spec in STEPS:
            mixes.append((spec, MIXES.get(spec, [])))
            continue
        lengths = []
        for part in spec.split(","):
            count, x, length = part.strip().rpartition("x")
            try:
                n, times = int(length), int(count) if x else 1
            except ValueError:
                raise ValueError(f"{spec!r}: give a named mix ({', '.join(MIXES)}), a serving step "
                                 f"({', '.join(STEPS)}) or lengths such as 8192,2x4096,8x512") from None
            if n < 1 or times < 1:
                raise ValueError(f"{spec!r}: lengths and counts must be >= 1, got {part.strip()!r}")
            lengths += [n] * times
        mixes.append((spec, lengths))
    return mixes


@dataclasses.dataclass
class VarlenConfig:
    """What `fusedattn bench --varlen` times; cli._apply_options sets its fields."""
    device: torch.device
    mixes: list[tuple[str, list[int]]]
    heads: int
    head_dim: int
    dtypes: list[str]  # one (the command line refuses more): its name in bench.DTYPES
    repeats: int
    warmup: int
    backward: bool = False  # time forward + backward


def default_config(device: torch.device, mixes: list[tuple[str, list[int]]]) -> VarlenConfig:
    if device.type == "cuda":
        return VarlenConfig(device, mixes, 16, 128, ["bfloat16"], repeats=10, warmup=3)
    return VarlenConfig(device, mixes, 4, 64, ["float32"], repeats=3, warmup=1)


def _rand(shape, cfg: VarlenConfig) -> torch.Tensor:
    return torch.randn(shape, device=cfg.device, dtype=bench.DTYPES[cfg.dtypes[0]]).requires_grad_(cfg.backward)


def _offsets(lengths: list[int], device: torch.device) -> torch.Tensor:
    """cu_seqlens of sequences of these lengths: int32 [B + 1]."""
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)


def _call(make: Callable[[], torch.Tensor], backward: bool, inputs: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    """One timed call of an output-making function: the forward, or forward and backward (the
    gradients of `inputs` returned, not accumulated)."""
    if not backward:
        return lambda: make()
    grad = make().detach().normal_()
    return lambda: torch.autograd.grad(make(), inputs, grad)


def methods(cfg: VarlenConfig, lengths: list[int]) -> dict[str, Callable[[], Callable[[], None]]]:
    """name -> build(), which makes the column's inputs and returns its timed call
    (raising NotImplementedError or RuntimeError where the column cannot run)."""
    h, d, dev = cfg.heads, cfg.head_dim, cfg.device
    total, longest = sum(lengths), max(lengths)
    cu = _offsets(lengths, dev)

    def varlen():
        q, k, v = (_rand((total, h, d), cfg) for _ in range(3))
        return _call(lambda: fusedattn.attention_varlen(q, k, v, cu, cu, longest, longest, is_causal=True),
                     cfg.backward, (q, k, v))

    def padded():
        q, k, v = (_rand((len(lengths), h, longest, d), cfg) for _ in range(3))
        keys = torch.arange(longest, device=dev) < torch.tensor(lengths, device=dev)[:, None]
        mask = keys[:, None, None, :]
        return _call(lambda: fusedattn.attention(q, k, v, attn_mask=mask, is_causal=True), cfg.backward, (q, k, v))

    def flex():
        if dev.type != "cuda":
            raise NotImplementedError("FlexAttention is timed on CUDA only")
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(torch.arange(len(lengths), device=dev), torch.tensor(lengths, device=dev))
        torch._dynamo.reset()  # a fresh compile per row (bench_mask._flex says why)
        block_mask = create_block_mask(lambda b, hh, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi), None, None, total,
                                       total, device=dev)
        compiled = torch.compile(flex_attention)
        q, k, v = (_rand((1, h, total, d), cfg) for _ in range(3))
        return _call(lambda: compiled(q, k, v, block_mask=block_mask), cfg.backward, (q, k, v))

    def jagged():
        offsets = cu.long()
        leaves = tuple(_rand((total, h, d), cfg) for _ in range(3))
        q, k, v = (torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2) for x in leaves)
        return _call(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).values(),
                     cfg.backward, leaves)

    def dense():
        n = rms_length(lengths)
        q, k, v = (_rand((max(1, total // n), h, n, d), cfg) for _ in range(3))
        return _call(lambda: fusedattn.attention(q, k, v, is_causal=True), cfg.backward, (q, k, v))

    return {"fusedattn-varlen": varlen, "fusedattn-padded": padded, "flex-docs": flex, "sdpa-jagged": jagged,
            "fusedattn-dense-rms": dense}


def rms_length(lengths: list[int]) -> int:
    """The root-mean-square length, rounded to a multiple of 64 (at least 64)."""
    return max(64, round(math.sqrt(sum(n * n for n in lengths) / len(lengths)) / 64) * 64)


def causal_pairs(lengths: list[int]) -> int:
    """Visible (query, key) pairs of causal sequences of these lengths."""
    return sum(n * (n + 1) // 2 for n in lengths)


def measure_row(cfg: VarlenConfig, name: str, lengths: list[int]) -> dict:
    """One mix: per column its median time, rate and peak memory, or why it did not run;
    fusedattn varlen's rate over each other column's."""
    lengths = list(lengths)
    random.Random(SHUFFLE_SEED).shuffle(lengths)
    torch.manual_seed(0)
    results = bench.measure_columns(methods(cfg, lengths), cfg.device, cfg.warmup, cfg.repeats,
                                    unavailable=(RuntimeError, NotImplementedError, TypeError, ImportError))
    per_pair = 4.0 * cfg.heads * cfg.head_dim * (1 + bench.BACKWARD_FLOP_RATIO if cfg.backward else 1)
    n = rms_length(lengths)
    pairs = {column: causal_pairs(lengths) for column in results}
    pairs["fusedattn-dense-rms"] = max(1, sum(lengths) // n) * causal_pairs([n])
    for column, result in results.items():
        if result["status"] == "ok":
            result["tflops"] = per_pair * pairs[column] / result["seconds"] / 1e12
    rate = lambda c: results[c]["tflops"] if results[c]["status"] == "ok" else None  # noqa: E731
    ratios = {f"fusedattn-varlen/{anchor}": rate("fusedattn-varlen") / rate(anchor)
              for anchor in ("fusedattn-padded", "flex-docs", "sdpa-jagged", "fusedattn-dense-rms")
              if rate("fusedattn-varlen") and rate(anchor)}
    return {"mix": name, "sequences": len(lengths), "tokens": sum(lengths), "longest": max(lengths),
            "rms_length": n, "backward": cfg.backward, "results": results, "ratios": ratios}


def step_methods(cfg: VarlenConfig, step: dict) -> dict[str, Callable[[], Callable[[], None]]]:
    """The serving step's columns: the packed call of decodes and prefills against their caches
    (attention_with_kvcache with cu_seqlens_q), the decodes alone (the decode kernel), and the
    prefills alone (attention_varlen); each appends its new keys in place, at unchanged lengths."""
    h, d, dev = cfg.heads, cfg.head_dim, cfg.device
    decodes, context, prefills = step["decodes"], step["context"], step["prefills"]
    dtype = bench.DTYPES[cfg.dtypes[0]]
    rand = lambda *shape: torch.randn(shape, device=dev, dtype=dtype)  # noqa: E731
    cu = lambda lengths: _offsets(lengths, dev)  # noqa: E731

    def packed_step():
        n_q = [1] * decodes + prefills
        total, capacity = sum(n_q), max(context, *prefills)
        k_cache, v_cache = rand(len(n_q), h, capacity, d), rand(len(n_q), h, capacity, d)
        lens = torch.tensor([context - 1] * decodes + [0] * len(prefills), dtype=torch.int32, device=dev)
        q, k_new, v_new, cu_q = rand(total, h, d), rand(total, h, d), rand(total, h, d), cu(n_q)
        return lambda: fusedattn.attention_with_kvcache(q, k_cache, v_cache, lens, k_new, v_new, cu_seqlens_q=cu_q)

    def decode():
        k_cache, v_cache = rand(decodes, h, context, d), rand(decodes, h, context, d)
        lens = torch.full((decodes,), context - 1, dtype=torch.int32, device=dev)
        q, k_new, v_new = (rand(decodes, h, 1, d) for _ in range(3))
        return lambda: fusedattn.attention_with_kvcache(q, k_cache, v_cache, lens, k_new, v_new)

    def prefill():
        total, cu_p = sum(prefills), cu(prefills)
        q, k, v = (rand(total, h, d) for _ in range(3))
        return lambda: fusedattn.attention_varlen(q, k, v, cu_p, cu_p, max(prefills), max(prefills), is_causal=True)

    return {"fusedattn-step": packed_step, "fusedattn-decode": decode, "fusedattn-prefill": prefill}


def measure_step(cfg: VarlenConfig, name: str) -> dict:
    """One serving step: per column its median time, or why it did not run; the packed step's
    time over the decode step's and the prefill's together."""
    step = STEPS[name]
    torch.manual_seed(0)
    results, timed = {}, {}
    with torch.no_grad():
        try:
            for column, build in step_methods(cfg, step).items():
                try:
                    call = build()
                    for _ in range(cfg.warmup):
                        call()
                except (RuntimeError, NotImplementedError) as e:
                    results[column] = bench.not_available(e)
                    continue
                results[column] = {"status": "ok"}
                timed[column] = lambda call=call: bench._time_once(call, cfg.device)
            for column, seconds in bench.interleaved_medians(timed, cfg.repeats).items():
                results[column] = seconds if isinstance(seconds, dict) else {"status": "ok", "seconds": seconds}
        finally:
            if cfg.device.type == "cuda":
                torch.cuda.empty_cache()
    seconds = {c: r["seconds"] for c, r in results.items() if r["status"] == "ok"}
    parts = ("fusedattn-decode", "fusedattn-prefill")
    over = (seconds["fusedattn-step"] / sum(seconds[c] for c in parts)
            if "fusedattn-step" in seconds and all(c in seconds for c in parts) else None)
    return {"mix": name, "step": step, "backward": False, "results": results, "step_over_parts": over}


def run(cfg: VarlenConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    rows = [measure_step(cfg, name) if name in STEPS else measure_row(cfg, name, lengths)
            for name, lengths in tqdm(cfg.mixes, desc="fusedattn bench --varlen", disable=not progress, unit="mix")]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": bench.describe_device(cfg.device),
        "device_type": cfg.device.type,
        "torch": torch.__version__,
        "config": {"varlen": [name for name, _ in cfg.mixes], "heads": cfg.heads, "head_dim": cfg.head_dim,
                   "dtype": cfg.dtypes[0], "repeats": cfg.repeats, "backward": cfg.backward},
        "methods": list(dict.fromkeys(m for row in rows for m in row["results"])),
        "rows": rows,
    }


def is_varlen(result: dict) -> bool:
    """Whether a saved result is `fusedattn bench --varlen`'s."""
    return "varlen" in result["config"]


def format_table(result: dict) -> str:
    """The markdown tables: per mix its shape, each column's rate and fusedattn varlen's ratios;
    per serving step its times and the packed step's over its parts'."""
    cfg = result["config"]
    unit, mult = bench._rate_unit(result)
    what = "forward + backward (FLOPs: 3.5x the forward)" if cfg["backward"] else "forward"
    title = bench.run_line(result) + "\n" + bench._wrap(
        f"packed sequences, causal per sequence, {what}, H={cfg['heads']} d={cfg['head_dim']} {cfg['dtype']}, "
        f"median of {cfg['repeats']} calls per cell; {unit} over the visible entries (varlen: attention_varlen; "
        f"padded: attention on the batch padded to its longest with a key-padding mask; flex: "
        f"FlexAttention with a document mask; jagged: SDPA on jagged nested tensors; dense: the dense "
        f"causal kernel at the mix's root-mean-square length, rms; max: the longest); x m = varlen's rate / m's")
    rows = [row for row in result["rows"] if "step" not in row]
    steps = [row for row in result["rows"] if "step" in row]
    tables = [title]
    if rows:
        tables.append(_mix_table(result, rows, mult))
    if steps:
        tables.append(_step_table(steps))
    return "\n\n".join(tables)


def _step_table(steps: list[dict]) -> str:
    """Serving steps: microseconds of the packed step, the decode step and the prefill, and the ratio."""
    header = ["step", "decodes", "context", "prefills", "step us", "decode us", "prefill us", "step/(decode+prefill)"]
    us = lambda row, c: bench.cell(row["results"][c], lambda r: bench.fmt3(r["seconds"] * 1e6))  # noqa: E731
    lines = [[row["mix"], str(row["step"]["decodes"]), str(row["step"]["context"]),
              ",".join(map(str, row["step"]["prefills"])), us(row, "fusedattn-step"), us(row, "fusedattn-decode"),
              us(row, "fusedattn-prefill"),
              bench.fmt_ratio(row["step_over_parts"]) if row["step_over_parts"] is not None else "-"]
             for row in steps]
    return bench._wrap("serving steps, forward, median microseconds per call: the packed step "
                       "(attention_with_kvcache with cu_seqlens_q), the decode step alone, the prefills alone "
                       "(attention_varlen)") + "\n\n" + bench.markdown_table(header, lines)


# Column labels short enough for bench.TABLE_WIDTH; the caption spells them out.
_LABELS = {"fusedattn-varlen": "varlen", "fusedattn-padded": "padded", "flex-docs": "flex", "sdpa-jagged": "jagged",
           "fusedattn-dense-rms": "dense"}


def _mix_table(result: dict, rows: list[dict], mult: float) -> str:
    names = [m for m in result["methods"] if any(m in row["results"] for row in rows)]
    ratio_names = list(dict.fromkeys(r for row in rows for r in row["ratios"] if r.startswith("fusedattn-varlen/")))
    label = lambda m: _LABELS.get(m, m)  # noqa: E731
    header = (["mix", "seqs", "max", "rms"] + [label(m) for m in names]
              + ["x " + label(r.split("/")[1]) for r in ratio_names])
    lines = [[row["mix"], str(row["sequences"]), str(row["longest"]), str(row["rms_length"])]
             + [bench.cell(row["results"][m], lambda r: bench.fmt3(r["tflops"] * mult)) if m in row["results"]
                else "-" for m in names]
             + [bench.fmt_ratio(row["ratios"][r]) if r in row["ratios"] else "-" for r in ratio_names]
             for row in rows]
    return bench.markdown_table(header, lines)
