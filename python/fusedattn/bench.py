"""The seed's benchmark: naive attention, PyTorch SDPA and fusedattn over N.

For every (dtype, causal, N) it reports the median time of each method,
fusedattn's TFLOP/s and the ratio of fusedattn's speed to each other method
(> 1: fusedattn is faster); with ``wide``, also each method's TFLOP/s, its peak
memory beyond the inputs (the output included) and the roofline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import platform
import random
import statistics
import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from . import backends, reference
from .ops import attention
from .memory import peak_bytes

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class Config:
    device: torch.device
    batch: int
    heads: int
    head_dim: int
    seqlens: list[int]
    dtypes: list[str]
    causal: list[bool]
    repeats: int
    warmup: int
    backward: bool = False  # time forward + backward
    methods: list[str] | None = None  # columns to time (fusedattn always); None: every one


def default_config(device: torch.device) -> Config:
    if device.type == "cuda":  # the seed's table
        return Config(device, 4, 32, 128, [1024, 2048, 4096, 8192, 16384, 32768], ["float16"],
                      [False, True], repeats=10, warmup=3)
    # On the CPU the naive path costs seconds a call from N=4K (it materialises the
    # scores): a first run compares with SDPA only; --methods naive,sdpa adds it.
    return Config(device, 1, 8, 64, [512, 1024, 2048, 4096], ["float32", "bfloat16"],
                  [False, True], repeats=5, warmup=1, methods=["sdpa"])


def forward_flops(cfg: Config, n: int, causal: bool) -> float:
    flops = 4.0 * cfg.batch * cfg.heads * n * n * cfg.head_dim
    return flops / 2 if causal else flops


# The backward's matmuls (S again, dV, dP, dQ, dK) are 2.5 times the forward's.
BACKWARD_FLOP_RATIO = 2.5


def timed_flops(cfg: Config, n: int, causal: bool) -> float:
    """FLOPs of what one timed call does: the forward, plus the backward with --backward."""
    return forward_flops(cfg, n, causal) * (1 + BACKWARD_FLOP_RATIO if cfg.backward else 1)


def sdpa_kernel_of(name: str):
    """The context manager holding SDPA to one backend: flash, efficient or cudnn."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "cudnn": SDPBackend.CUDNN_ATTENTION}[name])


def _sdpa_backend(name: str):
    def run(q, k, v, causal):
        # enable_gqa exists from torch 2.5: pass it only for grouped heads.
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        with sdpa_kernel_of(name):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)

    return run


class _Fusedattn:
    """fusedattn's forward under a setting that the bench holds around the
    forward and the backward alike (`setting()` is a context manager)."""

    def __init__(self, setting: Callable):
        self.setting = setting

    def __call__(self, q, k, v, causal):
        return attention(q, k, v, is_causal=causal)


@contextlib.contextmanager
def _deterministic_algorithms():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _kernel_family(family: str) -> _Fusedattn:
    return _Fusedattn(lambda: backends.force(family))


def methods(device: torch.device, backward: bool = False) -> dict[str, Callable]:
    """Name -> f(q, k, v, causal). The first one is the baseline of the table."""
    table = {
        "naive": lambda q, k, v, causal: reference.attention(q, k, v, is_causal=causal),
        "sdpa": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }
    if device.type == "cuda":
        table["naive-cuda"] = lambda q, k, v, causal: torch.ops.fusedattn.naive_forward(q, k, v, None, causal, None)
        for name in ("flash", "efficient", "cudnn"):
            table[f"sdpa-{name}"] = _sdpa_backend(name)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        # The default there is the sm90 family where it takes the call; the sm80 family alongside.
        table["fusedattn-sm80"] = _kernel_family("sm80")
    if device.type == "cuda" and backward:
        # torch.use_deterministic_algorithms(True): dQ summed in a fixed order (its cost).
        table["fusedattn-deterministic"] = _Fusedattn(_deterministic_algorithms)
    table["fusedattn"] = lambda q, k, v, causal: torch.ops.fusedattn.forward(q, k, v, None, causal, None)[0]
    return table


def min_bytes(cfg: Config, n: int, dtype: str) -> float:
    """Fewest bytes attention must move: q, k, v read once, out written once."""
    return 4.0 * cfg.batch * cfg.heads * n * cfg.head_dim * DTYPES[dtype].itemsize


def compute_dtype(device: torch.device, dtype: str) -> str:
    """The dtype fusedattn's kernels multiply in for inputs of `dtype`: float32
    on the CPU (they convert every tile to float32), the input's own on CUDA
    (tensor cores). The roofline's ceiling is a matmul in this dtype: PyTorch's
    CPU matmul in float16 has no fast path, so a float16 ceiling there sits far
    below what the float32 kernels reach."""
    return "float32" if device.type == "cpu" else dtype


def matmul_ceiling(cfg: Config, dtype: str) -> float:
    """Measured TFLOP/s of one large square matmul in `dtype`: the roofline's compute ceiling."""
    n = 8192 if cfg.device.type == "cuda" else 2048
    a, b = (torch.randn(n, n, device=cfg.device, dtype=DTYPES[dtype]) for _ in range(2))
    return 2.0 * n**3 / median_seconds(lambda: a @ b, cfg) / 1e12


def _time_once(fn, device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_seconds(fn, cfg: Config) -> float:
    for _ in range(cfg.warmup):
        fn()
    return statistics.median(_time_once(fn, cfg.device) for _ in range(cfg.repeats))


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _inputs(cfg: Config, dtype: str, n: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    shape = (cfg.batch, cfg.heads, n, cfg.head_dim)
    return tuple(torch.randn(shape, device=cfg.device, dtype=DTYPES[dtype]).requires_grad_(cfg.backward)
                 for _ in range(3))


def not_available(e: Exception) -> dict:
    """The status of a method that cannot take this input: the first line of its error."""
    return {"status": f"n/a ({str(e).splitlines()[0][:60]})"}


def _prepare(cfg: Config, inputs, causal: bool, name: str, fn) -> tuple[Callable | None, dict]:
    """(timed, result): timed() times one call of the method between events
    (its setting held around it); result holds its peak memory, or why it
    cannot run (then timed is None). Runs the peak-memory call and the
    warm-up."""
    q, k, v = inputs
    score_bytes = cfg.batch * cfg.heads * q.shape[2] * k.shape[2] * q.element_size()
    if name.startswith("naive") and 3 * score_bytes > _available_bytes(cfg.device):
        return None, {"status": "OOM (skipped: needs ~3 N^2 score matrices)"}
    if cfg.backward:
        if name == "naive-cuda":
            return None, {"status": "n/a (forward only)"}
        grad = torch.randn_like(q)

        def call():
            fn(q, k, v, causal).backward(grad)
            q.grad = k.grad = v.grad = None  # each call allocates its gradients afresh
    else:
        call = lambda: fn(q, k, v, causal)  # noqa: E731
    setting = getattr(fn, "setting", contextlib.nullcontext)
    try:
        with setting():
            memory = peak_bytes(call, cfg.device)
            for _ in range(cfg.warmup):
                call()
    except torch.OutOfMemoryError:
        return None, {"status": "OOM"}
    except (RuntimeError, NotImplementedError) as e:  # a backend that cannot take this input
        return None, not_available(e)

    def timed() -> float:
        with setting():
            return _time_once(call, cfg.device)

    return timed, {"status": "ok", "peak_bytes": memory}


def round_order(names: list[str], r: int) -> list[str]:
    """interleaved_medians' order of round r: names[r mod n] first, the others shuffled with seed r."""
    if not names:
        return []
    first = names[r % len(names)]
    rest = [name for name in names if name != first]
    random.Random(r).shuffle(rest)
    return [first] + rest


def interleaved_medians(timed: dict[str, Callable[[], float]], repeats: int,
                        recover_oom: bool = True) -> dict[str, float | dict]:
    """Median seconds of each timed() over `repeats` rounds, each round calling
    every method once; {"status": "OOM"} for a method that ran out of memory.
    A GPU at its power limit clocks by what ran just before, so a method timed
    first in a row reads faster than timed second (lab/order_effect.py
    measures it): round r starts with method r mod n and runs the others in an
    order shuffled with seed r, so that each method is first as often as any
    and follows a different method from round to round, not always the same
    one. The orders depend on r alone, the same on every rank of a distributed
    benchmark. recover_oom=False lets an OutOfMemoryError through (a
    distributed benchmark: the other ranks would wait on the failed one)."""
    names = list(timed)
    times: dict[str, list[float]] = {name: [] for name in names}
    failed: dict[str, dict] = {}
    for r in range(repeats):
        for name in round_order(names, r):
            if name in failed:
                continue
            try:
                times[name].append(timed[name]())
            except torch.OutOfMemoryError:
                if not recover_oom:
                    raise
                failed[name] = {"status": "OOM"}
    return {name: failed.get(name) or statistics.median(times[name]) for name in names}


def measure_columns(builds: dict[str, Callable[[], Callable[[], object]]], device: torch.device, warmup: int,
                    repeats: int, unavailable: tuple[type[Exception], ...] = (RuntimeError, NotImplementedError)
                    ) -> dict[str, dict]:
    """Per column: {"status": "ok", "peak_bytes", "seconds"} (the median of interleaved calls), or why it
    did not run. build() makes a column's inputs and returns its timed call; raising one of
    `unavailable` makes the column n/a, running out of memory OOM."""
    results, timed = {}, {}
    try:
        for column, build in builds.items():
            try:
                call = build()
                memory = peak_bytes(call, device)
                for _ in range(warmup):
                    call()
            except torch.OutOfMemoryError:
                results[column] = {"status": "OOM"}
                continue
            except unavailable as e:
                results[column] = not_available(e)
                continue
            results[column] = {"status": "ok", "peak_bytes": memory}
            timed[column] = lambda call=call: _time_once(call, device)
        for column, seconds in interleaved_medians(timed, repeats).items():
            results[column] = seconds if isinstance(seconds, dict) else {**results[column], "seconds": seconds}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def measure_row(cfg: Config, dtype: str, causal: bool, n: int, table: dict[str, Callable]) -> dict[str, dict]:
    """One row of the table: per method its median time, TFLOP/s and peak
    memory, or why it did not run. The methods take the same inputs and their
    timed calls interleave (interleaved_medians)."""
    inputs = _inputs(cfg, dtype, n)
    results, timed = {}, {}
    try:
        for name, fn in table.items():
            timed[name], results[name] = _prepare(cfg, inputs, causal, name, fn)
        medians = interleaved_medians({name: t for name, t in timed.items() if t is not None}, cfg.repeats)
    finally:
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
    flops = timed_flops(cfg, n, causal)
    for name, seconds in medians.items():
        if isinstance(seconds, dict):
            results[name] = seconds
        else:
            results[name].update(seconds=seconds, tflops=flops / seconds / 1e12)
    return results


def measure(cfg: Config, dtype: str, causal: bool, n: int, name: str, fn) -> dict:
    """One cell of the table: time, TFLOP/s and peak memory, or why it did not run."""
    return measure_row(cfg, dtype, causal, n, {name: fn})[name]


def select_methods(table: dict[str, Callable], names: list[str] | None) -> dict[str, Callable]:
    """The named columns of `table`, in its order, and fusedattn (the ratios are to it)."""
    if names is None:
        return table
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; this device has {list(table)}")
    return {m: fn for m, fn in table.items() if m in names or m == "fusedattn"}


def run(cfg: Config, progress: bool = True) -> dict:
    from tqdm import tqdm

    table = select_methods(methods(cfg.device, cfg.backward), cfg.methods)
    matmul_dtypes = {dt: compute_dtype(cfg.device, dt) for dt in cfg.dtypes}
    measured = {dt: matmul_ceiling(cfg, dt) for dt in sorted(set(matmul_dtypes.values()))}
    ceilings = {dt: measured[matmul_dtypes[dt]] for dt in cfg.dtypes}
    keys = [(dt, c, n) for dt in cfg.dtypes for c in cfg.causal for n in cfg.seqlens]
    with warnings.catch_warnings():
        # autograd's device thread meets cuBLAS before the CUDA context is current on it; torch
        # makes the primary context current itself, so the warning says nothing about the timings.
        warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")
        rows = [{"dtype": dt, "causal": c, "seqlen": n, "results": measure_row(cfg, dt, c, n, table)}
                for dt, c, n in tqdm(keys, desc="fusedattn bench", disable=not progress, unit="row")]
    for row in rows:
        fused = row["results"].get("fusedattn", {})
        flops = timed_flops(cfg, row["seqlen"], row["causal"])
        row["arithmetic_intensity"] = flops / min_bytes(cfg, row["seqlen"], row["dtype"])
        if fused.get("status") == "ok":
            row["fusedattn_pct_of_matmul"] = 100.0 * fused["tflops"] / ceilings[row["dtype"]]
        row["fusedattn_speedup"] = speedups(row["results"])
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": describe_device(cfg.device),
        "device_type": cfg.device.type,
        "torch": torch.__version__,
        "config": {"batch": cfg.batch, "heads": cfg.heads, "head_dim": cfg.head_dim,
                   "repeats": cfg.repeats, "threads": torch.get_num_threads(), "backward": cfg.backward},
        "methods": list(table),
        "matmul_tflops": ceilings,  # per row dtype, measured in matmul_dtype's
        "matmul_dtype": matmul_dtypes,
        "rows": rows,
    }


def speedups(results: dict) -> dict:
    """Time of each other method over fusedattn's, where both ran."""
    fused = results.get("fusedattn", {})
    if fused.get("status") != "ok":
        return {}
    return {m: r["seconds"] / fused["seconds"] for m, r in results.items()
            if m != "fusedattn" and r.get("status") == "ok"}


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu} ({torch.get_num_threads()} threads)"


def _fmt_bytes(b) -> str:
    return "-" if b is None else f"{b / 2**20:.0f} MiB" if b < 2**30 else f"{b / 2**30:.1f} GiB"


def fmt3(x: float) -> str:
    """x to about 3 significant digits without an exponent: 0.0123, 0.123, 1.23, 12.3, 123, 1234."""
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    decimals = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


def fmt_ratio(x: float) -> str:
    """A ratio with two decimals below 10 (1.05 and 0.95 differ), then 3 significant digits."""
    return f"{x:.2f}" if x < 10 else fmt3(x)


def cell(result: dict, fmt: Callable[[dict], str]) -> str:
    """fmt(result) for a method that ran; the first word of its status otherwise ("OOM", "n/a")."""
    return fmt(result) if result["status"] == "ok" else result["status"].split(" ")[0]


def markdown_table(header: list[str], lines: list[list[str]]) -> str:
    """A Markdown table with right-aligned columns as wide as their widest cell."""
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(header)]
    fmt = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(header), sep] + [fmt(l) for l in lines])


# The widest table `fusedattn bench` prints without --wide (a terminal's width).
TABLE_WIDTH = 120

# Column labels of the default table, short enough that the GPU's nine
# methods fit TABLE_WIDTH; the caption spells out those that differ.
SHORT_NAMES = {"sdpa-flash": "flash", "sdpa-efficient": "efficient", "sdpa-cudnn": "cudnn",
               "fusedattn-sm80": "fa-sm80", "fusedattn-deterministic": "fa-determ"}
_SDPA_BACKENDS = ("flash", "efficient", "cudnn")
_LEGEND = {"naive-cuda": "naive-cuda: fusedattn's naive CUDA kernel (materialises S)",
           "fa-sm80": "fa-sm80: fusedattn's sm80 kernels",
           "fa-determ": "fa-determ: fusedattn under torch.use_deterministic_algorithms"}


def short_name(method: str) -> str:
    return SHORT_NAMES.get(method, method)


def _rate_unit(result: dict) -> tuple[str, float]:
    """("TFLOP/s", 1) on CUDA, ("GFLOP/s", 1e3) on the CPU (its rates are tens of GFLOP/s)."""
    return ("TFLOP/s", 1) if device_type(result) == "cuda" else ("GFLOP/s", 1e3)


def device_type(result: dict) -> str:
    """result["device_type"]; for JSON written before that key, guessed from the device's name."""
    return result.get("device_type") or ("cpu" if result["device"].endswith("threads)") else "cuda")


def _wrap(text: str) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, TABLE_WIDTH, break_on_hyphens=False))


def run_line(result: dict) -> str:
    """The first line of a table's title: where and when the result was measured."""
    return _wrap(f"{result['device']}, torch {result['torch']}, {result['date']}")


def _title(result: dict) -> str:
    cfg = result["config"]
    what = "forward + backward (FLOPs: 3.5x the forward)" if cfg.get("backward") else "forward"
    return (run_line(result) + "\n"
            + _wrap(f"{what}, B={cfg['batch']} H={cfg['heads']} d={cfg['head_dim']}, median of "
                    f"{cfg['repeats']} calls per cell; x m = time of m / time of fusedattn "
                    f"(> 1: fusedattn is faster)"))


def _row_key(row: dict) -> list[str]:
    return [row["dtype"], "yes" if row["causal"] else "no", str(row["seqlen"])]


def ratio_cells(row: dict, others: list[str]) -> list[str]:
    return [fmt_ratio(row["fusedattn_speedup"][m]) if m in row["fusedattn_speedup"] else "-" for m in others]


def compact_table(title: str, key_header: list[str], keys: list[list[str]], names: list[str],
                  times: list[list[str]], rate_header: str, rates: list[str], ratios: list[list[str]]) -> str:
    """The default table of a bench: per row its key, each method's time in ms,
    fusedattn's rate and its speed-up over each other method ("x m"), in one
    table of at most TABLE_WIDTH columns, or in two (times, then the rate and
    the speed-ups) where one would be wider. Methods are labelled by short_name;
    the title gains the legend of the labels used."""
    labels = [short_name(m) for m in names]
    others = [short_name(m) for m in names if m != "fusedattn"]
    backends = [label for label in _SDPA_BACKENDS if label in labels]
    legend = [f"{', '.join(backends)}: SDPA held to that backend"] if backends else []
    legend += [text for label, text in _LEGEND.items() if label in labels]
    title = title + ("\n" + _wrap("; ".join(legend)) if legend else "")
    one = markdown_table(key_header + [f"{l} ms" for l in labels] + [rate_header] + [f"x {l}" for l in others],
                         [k + t + [r] + x for k, t, r, x in zip(keys, times, rates, ratios)])
    if max(map(len, one.splitlines())) <= TABLE_WIDTH:
        return title + "\n" + one
    first = markdown_table(key_header + labels, [k + t for k, t in zip(keys, times)])
    unit = rate_header.split()[-1]
    second = markdown_table(key_header + [unit] + others, [k + [r] + x for k, r, x in zip(keys, rates, ratios)])
    return (f"{title}\ntime per call, ms:\n{first}\n\n"
            f"fusedattn's {unit}, and its speed-up over each method m (time of m / time of fusedattn):\n{second}")


def format_table(result: dict, wide: bool = False) -> str:
    """The table `fusedattn bench` prints: per (dtype, causal, N) each method's
    time in ms, fusedattn's rate and its speed-up over each other method,
    at most TABLE_WIDTH columns wide (compact_table). wide: one table of every
    column with full names, also each method's rate and peak memory and the
    roofline (format_wide)."""
    if wide:
        return format_wide(result)
    names = result["methods"]
    others = [m for m in names if m != "fusedattn"]
    unit, mult = _rate_unit(result)
    rows = result["rows"]
    return compact_table(
        _title(result), ["dtype", "causal", "N"], [_row_key(row) for row in rows], names,
        [[cell(row["results"][m], lambda r: fmt3(r["seconds"] * 1e3)) for m in names] for row in rows],
        f"fusedattn {unit}",
        [cell(row["results"]["fusedattn"], lambda r: fmt3(r["tflops"] * mult)) for row in rows],
        [ratio_cells(row, others) for row in rows])


def format_wide(result: dict) -> str:
    """Every column: each method's time, rate and peak memory, fusedattn's
    speed-ups, and the roofline (arithmetic intensity, fusedattn's rate as a
    share of a large matmul's in the dtype the kernels compute in)."""
    names = result["methods"]
    unit, mult = _rate_unit(result)
    others = [m for m in names if m != "fusedattn"]
    header = (["dtype", "causal", "N"] + [f"{m} ms" for m in names] + [f"{m} {unit}" for m in names]
              + [f"x {m}" for m in others] + [f"mem {m}" for m in names]
              + ["AI flop/B", "fusedattn % matmul"])
    lines = []
    for row in result["rows"]:
        res = row["results"]
        lines.append(
            _row_key(row)
            + [cell(res[m], lambda r: fmt3(r["seconds"] * 1e3)) for m in names]
            + [cell(res[m], lambda r: fmt3(r["tflops"] * mult)) for m in names]
            + ratio_cells(row, others)
            + [cell(res[m], lambda r: _fmt_bytes(r["peak_bytes"])) for m in names]
            + [f"{row['arithmetic_intensity']:.0f}",
               f"{row['fusedattn_pct_of_matmul']:.0f}%" if "fusedattn_pct_of_matmul" in row else "-"]
        )
    cfg = result["config"]
    matmul_dtype = result.get("matmul_dtype", {})
    by_compute: dict[str, list[str]] = {}
    for d in result["matmul_tflops"]:
        by_compute.setdefault(matmul_dtype.get(d, d), []).append(d)
    ceilings = ", ".join(
        f"{c} {fmt3(result['matmul_tflops'][ds[0]] * mult)} {unit}"
        + (f" (for {' and '.join(ds)} inputs, which the kernels compute in {c})" if ds != [c] else "")
        for c, ds in by_compute.items())
    notes = (f"mem = peak beyond the inputs (output{' and gradients' if cfg.get('backward') else ''} included); "
             f"roofline: AI = FLOPs / bytes of q, k, v, out; % matmul = fusedattn's rate / a large square "
             f"matmul's in the dtype the kernels compute in: {ceilings}")
    return _title(result) + "\n" + _wrap(notes) + "\n" + markdown_table(header, lines)


# One colour per method across every panel and figure; fusedattn in black.
METHOD_COLOURS = {"fusedattn": "black", "naive": "#7f7f7f", "sdpa": "#1f77b4", "naive-cuda": "#8c564b",
                  "sdpa-flash": "#ff7f0e", "sdpa-efficient": "#2ca02c", "sdpa-cudnn": "#d62728",
                  "fusedattn-sm80": "#9467bd", "fusedattn-deterministic": "#e377c2"}
_SPARE_COLOURS = ["#17becf", "#bcbd22", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896"]


def _colours(methods: list[str]) -> dict[str, str]:
    spare = iter(_SPARE_COLOURS * 4)
    return {m: METHOD_COLOURS.get(m) or next(spare) for m in methods}


_SETTING = (("batch", "B"), ("heads", "H"), ("head_dim", "d"))


def _setting(result: dict, keys) -> str:
    c = result["config"]
    return " ".join(f"{short}={c[key]}" for key, short in _SETTING if key in keys)


def _differing(results: list[dict]) -> tuple[set, bool, bool]:
    """The config keys (of B, H, d) that differ between results, and whether
    the direction (forward or with the backward) and the device do."""
    keys = {key for key, _ in _SETTING if len({r["config"][key] for r in results}) > 1}
    return (keys, len({bool(r["config"].get("backward")) for r in results}) > 1,
            len({r["device"] for r in results}) > 1)


def _facets(results: list[dict]) -> list[tuple[str, dict, list[dict]]]:
    """(title, result, rows) per panel column: each result's rows split by
    (dtype, causal). The title names what tells the panels apart: where the
    results differ in their setting (e.g. d=64 and d=128), that too."""
    keys, direction, device = _differing(results)
    facets = []
    for r in results:
        for dtype, causal in dict.fromkeys((row["dtype"], row["causal"]) for row in r["rows"]):
            parts = [r["device"]] if device else []
            parts += [_setting(r, keys)] if keys else []
            parts += [("fwd+bwd" if r["config"].get("backward") else "forward")] if direction else []
            parts += [dtype, "causal" if causal else "not causal"]
            rows = [row for row in r["rows"] if (row["dtype"], row["causal"]) == (dtype, causal)]
            facets.append((", ".join(parts), r, rows))
    return facets


def _suptitle(results: list[dict], what: str) -> str:
    """`what`, and what every result shares: the device, B, H, d, the direction."""
    keys, direction, device = _differing(results)
    parts = [] if device else [results[0]["device"]]
    common = _setting(results[0], {key for key, _ in _SETTING} - keys)
    parts += [common] if common else []
    if not direction:
        parts += ["forward + backward" if results[0]["config"].get("backward") else "forward"]
    return f"{what}: " + ", ".join(parts)


def _seqlen_axis(ax, seqlens: list[int]) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.set_xscale("log", base=2)
    ticks = sorted(set(seqlens))
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n) for n in ticks])
    ax.set_xlabel("sequence length N")
    ax.grid(True, which="major", alpha=0.3)


def _speedup_axis(ax, facet_rows: list[dict], others: list[str], colours: dict) -> list[float]:
    """fusedattn's speed-up over each other method against N, and the line at
    1 (as fast as fusedattn); returns the speed-ups drawn."""
    drawn = []
    for m in others:
        pts = [(row["seqlen"], row["fusedattn_speedup"][m]) for row in facet_rows if m in row["fusedattn_speedup"]]
        if pts:
            ax.plot(*zip(*pts), "-", marker="o", ms=4, lw=1.8, color=colours[m], label=m)
            drawn += [x for _, x in pts]
    ax.axhline(1.0, color="black", lw=1.2)
    return drawn


def _speedup_scale(axes, drawn: list[float]) -> None:
    """One log scale for every speed-up panel, ticks as 0.5x, 1x, 2x, ..."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    lo, hi = min(drawn + [1.0]), max(drawn + [1.0])
    ticks = [t for t in (0.1, 0.2, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3, 4, 5, 10, 20, 50, 100, 200, 500, 1000)
             if lo / 1.15 <= t <= hi * 1.15]
    if hi / lo > 8:  # a wide range: the finer ticks would crowd
        ticks = [t for t in ticks if t not in (0.75, 1.25, 1.5, 3, 4, 0.25)]
    for ax in axes:
        ax.set_yscale("log")
        ax.set_ylim(lo / 1.25, hi * 1.25)
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))


def _legend(fig, axes, by_height: bool = False) -> None:
    """One legend for the figure, right of the panels (inside them it hides
    points); by_height: its entries top to bottom as the lines' last points."""
    entries = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if by_height:
        entries = dict(sorted(entries.items(), key=lambda e: -e[1].get_ydata()[-1]))
    fig.legend(entries.values(), entries.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False,
               fontsize=9)


def plot(results: dict | list[dict], path: str) -> list[str]:
    """Writes the figures of one or more bench results (figures()): all
    panels to `path`, the speed-up panels alone next to it (path's stem +
    "-speedup"). Returns the paths written."""
    import matplotlib.pyplot as plt

    stem, dot, suffix = path.rpartition(".")
    speedup_path = f"{stem}-speedup.{suffix}" if dot else f"{path}-speedup"
    for figure, out in zip(figures(results), (path, speedup_path)):
        figure.savefig(out, dpi=110, bbox_inches="tight")
        plt.close(figure)
    return [path, speedup_path]


def figures(results: dict | list[dict]):
    """(all, speed-up) matplotlib figures of one or more bench results. all:
    per (result, dtype, causal) a column of panels against N: fusedattn's
    speed-up over each other method (log, a line at 1x), each method's time
    (log) and its peak memory beyond the inputs (linear); speed-up: the first
    row alone. One colour per method throughout, one legend right of the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [results] if isinstance(results, dict) else list(results)
    facets = _facets(results)
    methods = list(dict.fromkeys(m for r in results for m in r["methods"]))
    colours = _colours(methods)
    others = [m for m in methods if m != "fusedattn"]

    cols = len(facets)
    fig, axes = plt.subplots(3, cols, figsize=(4.2 * cols + 0.5, 10.5), squeeze=False)
    # The speed-up figure alone: at most 3 panels a row (4 as 2 x 2), so it reads at a page's width.
    per_row = cols if cols <= 3 else 2 if cols == 4 else 3
    alone, grid = plt.subplots(-(-cols // per_row), per_row, figsize=(5.0 * per_row, 4.0 * -(-cols // per_row)),
                               squeeze=False)
    alone_axes = grid.flat[:cols]
    for spare in grid.flat[cols:]:
        spare.set_visible(False)
    drawn = []
    for col, (title, result, rows) in enumerate(facets):
        ax_s, ax_t, ax_m = axes[:, col]
        drawn += _speedup_axis(ax_s, rows, others, colours)
        _speedup_axis(alone_axes[col], rows, others, colours)
        memory_unit = 2**30 if max((r["results"][m].get("peak_bytes") or 0 for r in rows for m in r["results"]),
                                   default=0) >= 4 * 2**30 else 2**20
        for m in result["methods"]:
            ok = [(row["seqlen"], row["results"][m]) for row in rows
                  if m in row["results"] and row["results"][m]["status"] == "ok"]
            if not ok:
                continue
            style = dict(marker="o", ms=4, color=colours[m], label=m,
                         lw=2.4 if m == "fusedattn" else 1.5, zorder=3 if m == "fusedattn" else 2)
            ax_t.plot([n for n, _ in ok], [x["seconds"] * 1e3 for _, x in ok], "-", **style)
            mem = [(n, x["peak_bytes"]) for n, x in ok if x.get("peak_bytes") is not None]
            if mem:
                ax_m.plot([n for n, _ in mem], [b / memory_unit for _, b in mem], "-", **style)
        seqlens = [row["seqlen"] for row in rows]
        for ax in (ax_s, ax_t, ax_m, alone_axes[col]):
            _seqlen_axis(ax, seqlens)
            ax.set_title(title, fontsize=10)
        ax_t.set_yscale("log")
        ax_m.set_ylim(bottom=0)
        speedup_label = "fusedattn's speed-up over m\n(time of m / time of fusedattn;\nabove 1x: fusedattn is faster)"
        if col == 0:
            ax_s.set_ylabel(speedup_label)
            ax_t.set_ylabel("time per call, ms")
            ax_m.set_ylabel(f"peak memory beyond the inputs, {'GiB' if memory_unit == 2**30 else 'MiB'}")
        if col % per_row == 0:
            alone_axes[col].set_ylabel(speedup_label)
    _speedup_scale(list(axes[0]) + list(alone_axes), drawn)
    _legend(fig, axes.flat)
    _legend(alone, alone_axes, by_height=True)
    fig.suptitle(_suptitle(results, "fusedattn bench"))
    alone.suptitle(_suptitle(results, "fusedattn's speed-up over other attention kernels"))
    fig.tight_layout()
    alone.tight_layout()
    return fig, alone


def load_json(path: str) -> dict:
    """A result that save_json wrote (`fusedattn bench --json`, with or without
    --decode). Raises ValueError naming what is wrong with the file."""
    try:
        with open(path) as f:
            result = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a directory, not a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    needed = ("device", "torch", "date", "config", "methods", "rows")
    if not isinstance(result, dict) or any(k not in result for k in needed):
        raise ValueError(f"{path} is not a `fusedattn bench --json` result (it lacks {', '.join(needed)})")
    return result


def is_decode(result: dict) -> bool:
    """Whether a result is `fusedattn bench --decode`'s (its rows split by varlen, not causal)."""
    return bool(result["rows"]) and "varlen" in result["rows"][0]


def save_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
