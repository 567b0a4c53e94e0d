"""The seed's benchmark: naive attention, PyTorch SDPA and fusedattn over N.

For every (dtype, causal, N) it reports the median time of each method, its
TFLOP/s, the ratio of fusedattn's speed to each other method (> 1: fusedattn is
faster) and the peak memory beyond the inputs (the output included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from . import reference
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
    return Config(device, 1, 8, 64, [512, 1024, 2048, 4096], ["float32", "bfloat16"],
                  [False, True], repeats=5, warmup=1)


def forward_flops(cfg: Config, n: int, causal: bool) -> float:
    flops = 4.0 * cfg.batch * cfg.heads * n * n * cfg.head_dim
    return flops / 2 if causal else flops


# The backward's matmuls (S again, dV, dP, dQ, dK) are 2.5 times the forward's.
BACKWARD_FLOP_RATIO = 2.5


def timed_flops(cfg: Config, n: int, causal: bool) -> float:
    """FLOPs of what one timed call does: the forward, plus the backward with --backward."""
    return forward_flops(cfg, n, causal) * (1 + BACKWARD_FLOP_RATIO if cfg.backward else 1)


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION}[name]

    def run(q, k, v, causal):
        # enable_gqa exists from torch 2.5: pass it only for grouped heads.
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)

    return run


class _Fusedattn:
    """fusedattn's forward under a setting that the bench holds around the
    forward and the backward alike (`setting()` is a context manager)."""

    def __init__(self, setting: Callable):
        self.setting = setting

    def __call__(self, q, k, v, causal):
        return torch.ops.fusedattn.forward(q, k, v, None, causal, None)[0]


@contextlib.contextmanager
def _environment(variables: dict[str, str]):
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _deterministic_algorithms():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _kernel_family(family: str) -> _Fusedattn:
    return _Fusedattn(lambda: _environment({"FUSEDATTN_KERNEL_FAMILY": family}))


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
        # torch.use_deterministic_algorithms(True): dQ in a pass of its own (its cost).
        table["fusedattn-deterministic"] = _Fusedattn(_deterministic_algorithms)
    table["fusedattn"] = lambda q, k, v, causal: torch.ops.fusedattn.forward(q, k, v, None, causal, None)[0]
    return table


def min_bytes(cfg: Config, n: int, dtype: str) -> float:
    """Fewest bytes attention must move: q, k, v read once, out written once."""
    return 4.0 * cfg.batch * cfg.heads * n * cfg.head_dim * DTYPES[dtype].itemsize


def matmul_ceiling(cfg: Config, dtype: str) -> float:
    """Measured TFLOP/s of one large square matmul: the roofline's compute ceiling."""
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


def interleaved_medians(timed: dict[str, Callable[[], float]], repeats: int) -> dict[str, float | dict]:
    """Median seconds of each timed() over `repeats` rounds, each round calling
    every method once, starting one further along each time; {"status": "OOM"}
    for a method that ran out of memory. An H200 runs attention at its power
    limit and its clock follows what ran just before: timed one after the
    other, cuDNN timed first in a row read up to 17% faster than timed second
    (lab/order_effect.py, 2026-12-01)."""
    names = list(timed)
    times: dict[str, list[float]] = {name: [] for name in names}
    failed: dict[str, dict] = {}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            if name in failed:
                continue
            try:
                times[name].append(timed[name]())
            except torch.OutOfMemoryError:
                failed[name] = {"status": "OOM"}
    return {name: failed.get(name) or statistics.median(times[name]) for name in names}


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
    ceilings = {dt: matmul_ceiling(cfg, dt) for dt in cfg.dtypes}
    keys = [(dt, c, n) for dt in cfg.dtypes for c in cfg.causal for n in cfg.seqlens]
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
        "matmul_tflops": ceilings,
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


def cell(result: dict, fmt: Callable[[dict], str]) -> str:
    """fmt(result) for a method that ran; the first word of its status otherwise ("OOM", "n/a")."""
    return fmt(result) if result["status"] == "ok" else result["status"].split(" ")[0]


def markdown_table(header: list[str], lines: list[list[str]]) -> str:
    """A Markdown table with right-aligned columns as wide as their widest cell."""
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(header)]
    fmt = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(header), sep] + [fmt(l) for l in lines])


def format_table(result: dict) -> str:
    names = result["methods"]
    unit, mult = ("TFLOP/s", 1) if result["device_type"] == "cuda" else ("GFLOP/s", 1e3)
    others = [m for m in names if m != "fusedattn"]
    header = (["dtype", "causal", "N"] + [f"{m} ms" for m in names] + [f"{m} {unit}" for m in names]
              + [f"x {m}" for m in others] + [f"mem {m}" for m in names]
              + ["AI flop/B", "fusedattn % matmul"])
    lines = []
    for row in result["rows"]:
        res = row["results"]
        lines.append(
            [row["dtype"], "yes" if row["causal"] else "no", str(row["seqlen"])]
            + [cell(res[m], lambda r: f"{r['seconds'] * 1e3:.2f}") for m in names]
            + [cell(res[m], lambda r: f"{r['tflops'] * mult:.1f}") for m in names]
            + [f"{row['fusedattn_speedup'][m]:.2f}" if m in row["fusedattn_speedup"] else "-" for m in others]
            + [cell(res[m], lambda r: _fmt_bytes(r["peak_bytes"])) for m in names]
            + [f"{row['arithmetic_intensity']:.0f}",
               f"{row['fusedattn_pct_of_matmul']:.0f}%" if "fusedattn_pct_of_matmul" in row else "-"]
        )
    cfg = result["config"]
    title = (f"{result['device']}, torch {result['torch']}, {result['date']}\n"
             f"B={cfg['batch']} H={cfg['heads']} d={cfg['head_dim']}, "
             f"{'forward + backward (FLOPs: 3.5x the forward)' if cfg.get('backward') else 'forward'}, "
             f"median of {cfg['repeats']}; "
             f"'x m' = time of m / time of fusedattn; mem = peak beyond the inputs (output"
             f"{' and gradients' if cfg.get('backward') else ''} included); "
             f"roofline: AI = FLOPs / bytes of q, k, v, out; matmul ceiling "
             + ", ".join(f"{d} {t * mult:.0f} {unit}" for d, t in result["matmul_tflops"].items()) + "\n")
    return title + markdown_table(header, lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row_key in sorted({(r["dtype"], r["causal"]) for r in result["rows"]}):
        rows = [r for r in result["rows"] if (r["dtype"], r["causal"]) == row_key]
        for m in result["methods"]:
            pts = [(r["seqlen"], r["results"][m]) for r in rows if r["results"][m]["status"] == "ok"]
            if not pts:
                continue
            label = f"{m} {row_key[0]}{' causal' if row_key[1] else ''}"
            style = "-" if m == "fusedattn" else "--"
            ax_t.plot([n for n, _ in pts], [x["seconds"] * 1e3 for _, x in pts], style, marker="o", label=label)
            if pts[0][1]["peak_bytes"] is not None:
                ax_m.plot([n for n, _ in pts], [x["peak_bytes"] / 2**20 for _, x in pts], style, marker="o", label=label)
    for ax, title, ylabel in ((ax_t, "time", "ms"), (ax_m, "peak memory beyond inputs", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog" if ax is ax_m else "log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=7)
    fig.suptitle(f"fusedattn bench: {result['device']}, B={result['config']['batch']} "
                 f"H={result['config']['heads']} d={result['config']['head_dim']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
