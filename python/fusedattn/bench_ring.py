"""Ring attention over the ranks of a torch.distributed group, timed
(``torchrun --nproc-per-node W -m fusedattn bench --ring``).

Per sequence length N, every rank holds N/W positions. Timed, each the
slowest rank's time: the ring's forward and forward+backward; the same
computation with no transfer (each rank keeps its own shard: compute alone);
the transfers with no computation (communication alone); and one device's
attention at N/sqrt(W), which does the work one rank does in the ring. From
those: the share of the communication hidden behind compute, the ring's
overhead over compute alone, and its throughput against one device.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import time

import torch
import torch.distributed as dist

from .bench import DTYPES, _wrap, describe_device, fmt3, interleaved_medians, markdown_table, run_line
from .distributed.layout import chunks
from .distributed.ring import GRAD_TAG, KV_TAG, Ring, ring_backward, ring_forward


@dataclasses.dataclass
class RingConfig:
    device: torch.device
    batch: int = 1
    heads: int = 16
    kv_heads: int = 16
    head_dim: int = 128
    seqlens: list[int] = dataclasses.field(default_factory=lambda: [131072, 262144, 524288])
    dtypes: list[str] = dataclasses.field(default_factory=lambda: ["bfloat16"])
    causal: list[bool] = dataclasses.field(default_factory=lambda: [True])
    layout: str = "zigzag"
    repeats: int = 3
    warmup: int = 1


def default_config(device: torch.device) -> RingConfig:
    if device.type == "cuda":
        return RingConfig(device)
    return RingConfig(device, heads=4, kv_heads=4, head_dim=64, seqlens=[2048, 4096], dtypes=["float32"])


def multiple(world: int, layout: str) -> int:
    """What every N must be a multiple of: the layout's chunk count over world ranks."""
    return chunks(0, world, layout)[0]


def flops(cfg: RingConfig, n: int, causal: bool, backward: bool) -> float:
    """Useful FLOPs of attention over n positions (forward + backward: 3.5x the forward)."""
    forward = 4 * cfg.batch * cfg.heads * n * n * cfg.head_dim / (2 if causal else 1)
    return forward * (3.5 if backward else 1.0)


def _slowest(fn, device: torch.device) -> float:
    """Seconds of fn() on the slowest rank, every rank starting together."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _calls(cfg: RingConfig, ring: Ring, dtype: str, causal: bool, n: int) -> dict:
    """name -> a call of what the row times."""
    dt, local = DTYPES[dtype], n // ring.world
    g = torch.Generator(device=cfg.device).manual_seed(ring.rank)

    def randn(heads: int, length: int) -> torch.Tensor:
        return torch.randn(cfg.batch, heads, length, cfg.head_dim, device=cfg.device, dtype=dt, generator=g)

    q, grad = randn(cfg.heads, local), randn(cfg.heads, local)
    k, v = randn(cfg.kv_heads, local), randn(cfg.kv_heads, local)
    options = (causal, None, cfg.layout, None)

    def train(communicate: bool) -> None:
        out, lse = ring_forward(ring, q, k, v, *options, communicate=communicate)
        ring_backward(ring, grad, q, k, v, out, lse, *options, communicate=communicate)

    def transfers(backward: bool) -> None:  # the ring's messages in its order, nothing computed
        for _ in range(ring.world - 1):
            ring.pass_on((k, v), KV_TAG).wait()
        if backward:
            for _ in range(ring.world - 1):
                ring.pass_on((k, v), KV_TAG).wait()
            zeros = tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
            for _ in range(ring.world):
                ring.pass_on(zeros, GRAD_TAG).wait()

    # One device doing one rank's share of the ring's work.
    single = max(1, round(n / math.sqrt(ring.world)))
    q1, g1 = randn(cfg.heads, single), randn(cfg.heads, single)
    k1, v1 = randn(cfg.kv_heads, single), randn(cfg.kv_heads, single)

    def single_train() -> None:
        out, lse = torch.ops.fusedattn.forward(q1, k1, v1, None, causal, None)
        torch.ops.fusedattn.backward(g1, q1, k1, v1, out, lse, None, causal, None)

    return {
        "ring": lambda: ring_forward(ring, q, k, v, *options),
        "compute": lambda: ring_forward(ring, q, k, v, *options, communicate=False),
        "comm": lambda: transfers(False),
        "single": lambda: torch.ops.fusedattn.forward(q1, k1, v1, None, causal, None),
        "ring_train": lambda: train(True),
        "compute_train": lambda: train(False),
        "comm_train": lambda: transfers(True),
        "single_train": single_train,
    }, single


def measure_row(cfg: RingConfig, ring: Ring, dtype: str, causal: bool, n: int) -> dict:
    calls, single = _calls(cfg, ring, dtype, causal, n)
    for call in calls.values():
        for _ in range(cfg.warmup):
            call()
    # No recovery from running out of memory: the other ranks would wait for
    # the failed one's messages, so an error ends every process (torchrun stops the rest).
    timed = {name: (lambda call=call: _slowest(call, cfg.device)) for name, call in calls.items()}
    seconds = interleaved_medians(timed, cfg.repeats, recover_oom=False)
    row = {"status": "ok", "seconds": seconds, "single_seqlen": single}
    for phase, backward in (("", False), ("_train", True)):
        ring_s, compute_s, comm_s = (seconds[m + phase] for m in ("ring", "compute", "comm"))
        ring_rate = flops(cfg, n, causal, backward) / ring_s
        single_rate = flops(cfg, single, causal, backward) / seconds["single" + phase]
        row["fwd" if not backward else "train"] = {
            "tflops": ring_rate / 1e12,
            "overhead": ring_s / compute_s - 1,  # time the communication adds to compute alone
            "hidden": min(1.0, max(0.0, 1 - (ring_s - compute_s) / comm_s)) if comm_s > 0 else 1.0,
            "speedup": ring_rate / single_rate,  # against one device at the same work per device
            "efficiency": ring_rate / single_rate / ring.world,
        }
    return row


def run(cfg: RingConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    ring = Ring()
    keys = [(dt, c, n) for dt in cfg.dtypes for c in cfg.causal for n in cfg.seqlens]
    shown = progress and ring.rank == 0
    rows = [{"dtype": dt, "causal": c, "seqlen": n, "result": measure_row(cfg, ring, dt, c, n)}
            for dt, c, n in tqdm(keys, desc="fusedattn bench --ring", disable=not shown, unit="row")]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{ring.world} x {describe_device(cfg.device)}",
        "device_type": cfg.device.type,
        "torch": torch.__version__,
        "config": {"ring": True, "world": ring.world, "backend": dist.get_backend(), "layout": cfg.layout,
                   "batch": cfg.batch, "heads": cfg.heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                   "repeats": cfg.repeats},
        "methods": ["ring", "compute", "comm", "single"],
        "rows": rows,
    }


def format_table(result: dict) -> str:
    cfg = result["config"]
    unit, div = ("TFLOP/s", 1) if result["device_type"] == "cuda" else ("GFLOP/s", 1e-3)
    title = run_line(result) + "\n" + _wrap(
        f"ring attention over {cfg['world']} ranks ({cfg['backend']}, {cfg['layout']}), B={cfg['batch']} "
        f"Hq={cfg['heads']} Hkv={cfg['kv_heads']} d={cfg['head_dim']}, median of {cfg['repeats']}, each the "
        f"slowest rank's time; {unit}: of all ranks together, over the whole sequence's useful FLOPs "
        f"(forward+backward: 3.5x); overhead (transfers left exposed, and compute slowed by them): "
        f"ring time over compute alone - 1; hidden: share of communication time hidden behind compute; "
        f"x single: throughput over one device at N/sqrt(W) (the same work per device); efficiency: x single / W")
    header = ["dtype", "causal", "N", "phase", "ms", "comm ms", unit, "overhead", "hidden", "x single",
              "efficiency"]
    lines = []
    for row in result["rows"]:
        r = row["result"]
        key = [row["dtype"], "yes" if row["causal"] else "no", str(row["seqlen"])]
        if r["status"] != "ok":
            lines.append(key + [r["status"]] + ["-"] * 7)
            continue
        for phase, suffix in (("fwd", ""), ("train", "_train")):
            p = r[phase]
            lines.append(key + [phase, fmt3(r["seconds"]["ring" + suffix] * 1e3),
                                fmt3(r["seconds"]["comm" + suffix] * 1e3), fmt3(p["tflops"] / div),
                                f"{p['overhead'] * 100:+.1f}%", f"{p['hidden'] * 100:.0f}%",
                                f"{p['speedup']:.2f}", f"{p['efficiency'] * 100:.0f}%"])
    return title + "\n" + markdown_table(header, lines)
