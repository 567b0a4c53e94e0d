"""Decoding attention: one new query per sequence against a long KV cache.

Memory bound, so the figure of merit is bandwidth: bytes of K and V that the
step must read (each sequence's valid positions, once) per second. fusedattn's
forward_kvcache is timed against PyTorch's SDPA backends given the same q and
a K/V of exactly the cache length. With per-sequence lengths (``varlen``) SDPA
has no equivalent (it would read the whole cache), so only fusedattn runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import time

import torch
import torch.nn.functional as F

from .bench import (DTYPES, _sdpa_backend, _time_once, _wrap, cell, compact_table, describe_device, fmt3,
                    interleaved_medians, markdown_table, not_available, ratio_cells, run_line, select_methods,
                    speedups)


# Calls per timed interval: a step over a 4K cache takes about 0.1 ms, close to
# what launching it costs on the host.
CALLS_PER_TIMING = 10
# Unless launch_gaps, the GPU sleeps before each interval for this many times
# the host's time to enqueue its calls (QueuedTiming), so the interval's
# events see the kernels back to back: what a step replayed from a CUDA graph
# (as fusedattn.engine runs them) costs. Timed with the launches, a short step
# reads the host's launch time, not the kernel's: SDPA cuDNN's host time per
# call exceeds a GQA 4K step's GPU time (lab/call_gap.py measures both).
SLEEP_OVER_ENQUEUE = 3.0


@dataclasses.dataclass
class DecodeConfig:
    device: torch.device
    batch: int = 8
    heads: int = 32
    kv_heads: int = 32
    head_dim: int = 128
    seqlens: list[int] = dataclasses.field(default_factory=lambda: [4096, 32768, 131072])
    dtypes: list[str] = dataclasses.field(default_factory=lambda: ["float16"])
    varlen: list[bool] = dataclasses.field(default_factory=lambda: [False, True])
    repeats: int = 10
    warmup: int = 2
    methods: list[str] | None = None  # columns besides fusedattn (None: all)
    launch_gaps: bool = False  # time the host's launches too (see SLEEP_OVER_ENQUEUE)
    # Positions the caches hold (max_len), at least every N; None: each row's N.
    # forward_kvcache chooses its split count from this, not from the lengths.
    capacity: int | None = None
    num_splits: int | None = None  # fusedattn's split count (1-64); None: the planner's
    # Pages of this many positions: a fusedattn-paged column reads the same
    # keys and values through a block_table (pages in shuffled order); None: no column.
    page_size: int | None = None


def cache_lengths(cfg: DecodeConfig, n: int, varlen: bool) -> torch.Tensor:
    """Every sequence at n, or (varlen) lengths drawn uniformly from [1, n], seeded."""
    if not varlen:
        return torch.full((cfg.batch,), n, dtype=torch.int32)
    g = torch.Generator().manual_seed(n)
    return torch.randint(1, n + 1, (cfg.batch,), generator=g, dtype=torch.int32)


def _sdpa(name: str):
    run = _sdpa_backend(name)
    return lambda q, k, v, lengths, block_table: run(q, k, v, False)


def methods(cfg: DecodeConfig) -> dict:
    """Name -> f(q, k_cache, v_cache, lengths, block_table); the SDPA ones read
    all of k and v; block_table is None but for fusedattn-paged, whose caches
    are pages (to_pages)."""
    table = {f"sdpa-{name}": _sdpa(name) for name in ("flash", "efficient", "cudnn")}
    table["fusedattn"] = lambda q, k, v, lengths, block_table: torch.ops.fusedattn.forward_kvcache(
        q, k, v, lengths, None, None, True, None, cfg.num_splits, block_table=block_table)[0]
    if cfg.page_size is not None:
        table["fusedattn-paged"] = table["fusedattn"]
    return table


def to_pages(k: torch.Tensor, v: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The caches [B, Hkv, N, d] as pages [B * N / page_size, Hkv, page_size, d]
    in a shuffled order (a served cache's pages are not in order), and the
    block_table int32 [B, N / page_size] that reads them as they were."""
    batch, heads, n, d = k.shape
    per_sequence = n // page_size
    order = torch.randperm(batch * per_sequence, generator=torch.Generator().manual_seed(0)).to(k.device)

    def paged(cache):
        pages = cache.view(batch, heads, per_sequence, page_size, d).transpose(1, 2).reshape(-1, heads, page_size, d)
        return torch.empty_like(pages).index_copy_(0, order, pages)

    return paged(k), paged(v), order.view(batch, per_sequence).int()


def _sleep_cycles_per_second(device: torch.device) -> float:
    """How fast torch.cuda._sleep spins on this device (its clock, as it runs now)."""
    cycles = 20_000_000
    torch.cuda._sleep(1000)  # the first call's launch is not part of the sleep
    seconds = _time_once(lambda: torch.cuda._sleep(cycles), device)
    return cycles / seconds


class QueuedTiming:
    """Seconds per call of calls() (calls_per_interval calls), timed between two
    events after the GPU slept while the host queued them. The sleep starts
    at SLEEP_OVER_ENQUEUE times the host's time to enqueue calls(), measured
    here with the GPU kept busy. Where an interval's sleep ended before the
    host had queued its last call (the start event had run: the host was
    slower than measured), it is timed again with a longer sleep, at most
    MAX_TRIES times; short_sleeps counts those intervals."""

    MAX_TRIES = 3

    def __init__(self, calls, device: torch.device, calls_per_interval: int = CALLS_PER_TIMING):
        self.calls, self.calls_per_interval = calls, calls_per_interval
        self.rate = _sleep_cycles_per_second(device)
        torch.cuda._sleep(int(self.rate * 0.05))  # 50 ms: calls() below only queues
        start = time.perf_counter()
        calls()
        self.cycles = self._cycles_for(time.perf_counter() - start)
        torch.cuda.synchronize(device)
        self.short_sleeps = 0

    def _cycles_for(self, enqueue_seconds: float) -> int:
        return max(1, int(self.rate * SLEEP_OVER_ENQUEUE * enqueue_seconds))

    def __call__(self) -> float:
        for _ in range(self.MAX_TRIES):
            torch.cuda._sleep(self.cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            self.calls()
            enqueue = time.perf_counter() - t0
            end.record()
            queued = not start.query()
            end.synchronize()
            if queued:
                break
            self.short_sleeps += 1
            self.cycles = max(2 * self.cycles, self._cycles_for(enqueue))
        return start.elapsed_time(end) / 1e3 / self.calls_per_interval


def measure_row(cfg: DecodeConfig, dtype: str, n: int, varlen: bool, table: dict) -> dict[str, dict]:
    """One row: per method its median time and bandwidth, or why it did not
    run. The methods read the same cache, and their timed calls interleave
    (bench.interleaved_medians)."""
    capacity = cfg.capacity or n  # run() checked that it holds n
    skipped = ("n/a (no per-sequence lengths)" if varlen
               else "n/a (no cache capacity: reads a cache of N)" if capacity > n else None)
    results = {name: {"status": skipped} for name in table if skipped and not name.startswith("fusedattn")}
    torch.manual_seed(0)
    dt = DTYPES[dtype]
    q = torch.randn(cfg.batch, cfg.heads, 1, cfg.head_dim, device=cfg.device, dtype=dt)
    k, v = (torch.randn(cfg.batch, cfg.kv_heads, capacity, cfg.head_dim, device=cfg.device, dtype=dt)
            for _ in range(2))
    lengths = cache_lengths(cfg, n, varlen).to(cfg.device)
    useful = 2 * int(lengths.sum()) * cfg.kv_heads * cfg.head_dim * q.element_size()
    operands = {name: (k, v, None) for name in table}
    if "fusedattn-paged" in table:
        operands["fusedattn-paged"] = to_pages(k, v, cfg.page_size)
    timed = {}
    try:
        for name, fn in table.items():
            if name in results:
                continue

            def calls(fn=fn, name=name):  # back to back, so the launch overheads of one call hide behind the last
                k_cache, v_cache, block_table = operands[name]
                for _ in range(CALLS_PER_TIMING):
                    fn(q, k_cache, v_cache, lengths, block_table)

            try:
                for _ in range(cfg.warmup):
                    calls()
                timed[name] = (lambda calls=calls: _time_once(calls, cfg.device) / CALLS_PER_TIMING
                               ) if cfg.launch_gaps else QueuedTiming(calls, cfg.device)
            except torch.OutOfMemoryError:
                results[name] = {"status": "OOM"}
                continue
            except (RuntimeError, NotImplementedError) as e:
                results[name] = not_available(e)
                continue
        # Every method sleeps as long as the slowest to enqueue needs: the
        # card's clock recovers while it sleeps (bench.interleaved_medians).
        timers = [t for t in timed.values() if isinstance(t, QueuedTiming)]
        longest = max((t.cycles for t in timers), default=0)
        for timer in timers:
            timer.cycles = longest
        for name, seconds in interleaved_medians(timed, cfg.repeats).items():
            results[name] = seconds if isinstance(seconds, dict) else {
                "status": "ok", "seconds": seconds, "kv_bytes": useful, "tb_per_s": useful / seconds / 1e12}
            if isinstance(timed.get(name), QueuedTiming):
                results[name]["short_sleeps"] = timed[name].short_sleeps
    finally:
        del k, v, operands
        torch.cuda.empty_cache()
    return {name: results[name] for name in table}


def capacity_problem(cfg: DecodeConfig) -> str | None:
    """Why cfg.capacity (or cfg.page_size) cannot hold the table's caches, or None where it can."""
    if cfg.capacity is not None and cfg.capacity < max(cfg.seqlens):
        return f"--capacity must be at least every N (the largest is {max(cfg.seqlens)}), got {cfg.capacity}"
    if cfg.page_size is not None:
        caches = [cfg.capacity] if cfg.capacity is not None else cfg.seqlens
        if any(n % cfg.page_size for n in caches):
            return (f"--paged: the page size must divide every cache's positions "
                    f"({', '.join(map(str, caches))}), got {cfg.page_size}")
    return None


def run(cfg: DecodeConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    # The command line checks both before it calls run().
    problem = capacity_problem(cfg)
    if problem:
        raise ValueError(f"fusedattn bench --decode: {problem}")
    if cfg.device.type != "cuda":
        raise ValueError("fusedattn bench --decode: the decode benchmark needs a CUDA device")
    paged = ["fusedattn-paged"] if cfg.page_size is not None else []
    table = select_methods(methods(cfg), cfg.methods + paged if cfg.methods is not None else None)
    keys = [(dt, vl, n) for dt in cfg.dtypes for vl in cfg.varlen for n in cfg.seqlens]
    rows = [{"dtype": dt, "varlen": vl, "seqlen": n, "results": measure_row(cfg, dt, n, vl, table)}
            for dt, vl, n in tqdm(keys, desc="fusedattn bench --decode", disable=not progress, unit="row")]
    for row in rows:
        row["fusedattn_speedup"] = speedups(row["results"])
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": describe_device(cfg.device),
        "torch": torch.__version__,
        "config": {"batch": cfg.batch, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
                   "head_dim": cfg.head_dim, "repeats": cfg.repeats, "launch_gaps": cfg.launch_gaps,
                   "capacity": cfg.capacity, "num_splits": cfg.num_splits, "page_size": cfg.page_size},
        "methods": list(table),
        "rows": rows,
    }


def format_table(result: dict, wide: bool = False) -> str:
    """Per (dtype, lengths, N) each method's time in ms, fusedattn's TB/s and
    its speed-up over each other method, at most bench.TABLE_WIDTH columns
    wide; wide: also every method's TB/s, with full names."""
    names = result["methods"]
    others = [m for m in names if m != "fusedattn"]
    rows = result["rows"]
    keys = [[row["dtype"], "1..N" if row["varlen"] else "N", str(row["seqlen"])] for row in rows]
    times = [[cell(row["results"][m], lambda r: fmt3(r["seconds"] * 1e3)) for m in names] for row in rows]
    ratios = [ratio_cells(row, others) for row in rows]
    cfg = result["config"]
    caches = f", caches of {cfg['capacity']} positions" if cfg.get("capacity") else ""
    title = (run_line(result) + "\n" + _wrap(
        f"decode: B={cfg['batch']} Hq={cfg['heads']} Hkv={cfg['kv_heads']} d={cfg['head_dim']}, "
        f"1 query per sequence{caches}, median of {cfg['repeats']} intervals of {CALLS_PER_TIMING} calls "
        f"({'the host launching them' if cfg.get('launch_gaps') else 'queued while the GPU slept'}); "
        f"TB/s = bytes of the valid K and V / time; lengths 1..N: per-sequence lengths drawn from [1, N]; "
        f"x m = time of m / time of fusedattn (> 1: fusedattn is faster)"))
    if not wide:
        return compact_table(title, ["dtype", "lengths", "N"], keys, names, times, "fusedattn TB/s",
                             [cell(row["results"]["fusedattn"], lambda r: f"{r['tb_per_s']:.2f}") for row in rows],
                             ratios)
    header = (["dtype", "lengths", "N"] + [f"{m} ms" for m in names] + [f"{m} TB/s" for m in names]
              + [f"x {m}" for m in others])
    lines = [k + t + [cell(row["results"][m], lambda r: f"{r['tb_per_s']:.2f}") for m in names] + x
             for k, t, x, row in zip(keys, times, ratios, rows)]
    return title + "\n" + markdown_table(header, lines)
