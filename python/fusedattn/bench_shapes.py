"""`fusedattn bench --shapes SET`: attention at the shapes short-sequence
models run, microseconds per call against every SDPA backend.

The set ``encoder``: BERT-base (N=128 and 512, B=32, H=12, d=64, key padding:
lengths N, N/2, N/4, 3N/4 by batch item), ViT-B/16 (N=197, B=128, H=12, d=64),
ViT-L/14 (N=257, B=64, H=16, d=64) and Stable Diffusion UNets' self-attention
(N=4096, B=2, H=8, d=40 and 80; N=1024, d=160). fusedattn takes the padding as
a dense bool ``[B, 1, 1, N]`` mask, as SDPA does (its flash backend takes no
mask). Interleaved per row (bench.interleaved_medians); the ratio is the
fastest SDPA backend's time over fusedattn's (> 1: fusedattn is faster).
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Callable

import torch
import torch.nn.functional as F

import fusedattn

from . import bench
from .bench_mask import keypad_lengths


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    key_padding: bool = False


SHAPES = {
    "bert-128": Shape(32, 12, 128, 64, key_padding=True),
    "bert-512": Shape(32, 12, 512, 64, key_padding=True),
    "vit-b16": Shape(128, 12, 197, 64),
    "vit-l14": Shape(64, 16, 257, 64),
    "unet-4096-d40": Shape(2, 8, 4096, 40),
    "unet-4096-d80": Shape(2, 8, 4096, 80),
    "unet-1024-d160": Shape(2, 8, 1024, 160),
}
SETS = {"encoder": list(SHAPES)}


def parse_shapes(specs: list[str]) -> list[str]:
    """The shape names of each --shapes spec (a set or comma-separated shape
    names), in order, each once. Raises ValueError naming the unknown one."""
    names = []
    for spec in specs:
        for part in (p.strip() for p in spec.split(",") if p.strip()):
            if part not in SETS and part not in SHAPES:
                raise ValueError(f"unknown shape {part!r}; give the set {', '.join(SETS)} or shapes among "
                                 f"{', '.join(SHAPES)}")
            names += SETS.get(part, [part])
    return list(dict.fromkeys(names))


@dataclasses.dataclass
class ShapesConfig:
    """What `fusedattn bench --shapes` times; cli._apply_options sets its fields."""
    device: torch.device
    shapes: list[str]
    dtypes: list[str]  # one (the command line refuses more): its name in bench.DTYPES
    repeats: int
    warmup: int
    batch: int | None = None  # every shape's batch instead of its own (quick runs)
    backward: bool = False  # time forward + backward


def default_config(device: torch.device, shapes: list[str]) -> ShapesConfig:
    if device.type == "cuda":
        return ShapesConfig(device, shapes, ["bfloat16"], repeats=30, warmup=5)
    return ShapesConfig(device, shapes, ["float32"], repeats=5, warmup=1)


def methods(cfg: ShapesConfig, shape: Shape, batch: int) -> dict[str, Callable[[], Callable[[], object]]]:
    """name -> build(), which makes the column's inputs and returns its timed
    call (raising NotImplementedError or RuntimeError where it cannot run)."""
    dev, dtype = cfg.device, bench.DTYPES[cfg.dtypes[0]]
    mask = None
    if shape.key_padding:
        keys = torch.arange(shape.seqlen, device=dev) < keypad_lengths(batch, shape.seqlen, dev)[:, None]
        mask = keys[:, None, None, :]

    def build(attend: Callable) -> Callable[[], Callable[[], object]]:
        def make():
            q, k, v = (torch.randn(batch, shape.heads, shape.seqlen, shape.head_dim, device=dev, dtype=dtype)
                       .requires_grad_(cfg.backward) for _ in range(3))
            call = lambda: attend(q, k, v)  # noqa: E731
            if not cfg.backward:
                return call
            grad = call().detach().normal_()
            return lambda: torch.autograd.grad(call(), (q, k, v), grad)

        return make

    table = {"fusedattn": build(lambda q, k, v: fusedattn.attention(q, k, v, attn_mask=mask)),
             "sdpa": build(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))}
    if dev.type == "cuda":
        for name in ("flash", "efficient", "cudnn"):
            def backend(q, k, v, name=name):
                with bench.sdpa_kernel_of(name):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

            table[f"sdpa-{name}"] = build(backend)
    return table


def measure_row(cfg: ShapesConfig, name: str) -> dict:
    """One shape: per column its median microseconds and peak memory, or why it did not run."""
    shape = SHAPES[name]
    batch = cfg.batch or shape.batch
    torch.manual_seed(0)
    results = bench.measure_columns(methods(cfg, shape, batch), cfg.device, cfg.warmup, cfg.repeats)
    for result in results.values():
        if result["status"] == "ok":
            result["us"] = result["seconds"] * 1e6
    sdpa = [r["us"] for c, r in results.items() if c.startswith("sdpa") and r["status"] == "ok"]
    fused = results["fusedattn"]
    ratio = min(sdpa) / fused["us"] if sdpa and fused["status"] == "ok" else None
    return {"shape": name, **dataclasses.asdict(shape), "batch": batch, "backward": cfg.backward,
            "results": results, "fusedattn_over_best_sdpa": ratio}


def run(cfg: ShapesConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    rows = [measure_row(cfg, name)
            for name in tqdm(cfg.shapes, desc="fusedattn bench --shapes", disable=not progress, unit="shape")]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": bench.describe_device(cfg.device),
        "device_type": cfg.device.type,
        "torch": torch.__version__,
        "config": {"shapes": cfg.shapes, "dtype": cfg.dtypes[0], "repeats": cfg.repeats, "backward": cfg.backward},
        "methods": list(dict.fromkeys(m for row in rows for m in row["results"])),
        "rows": rows,
    }


def is_shapes(result: dict) -> bool:
    """Whether a saved result is `fusedattn bench --shapes`'s."""
    return "shapes" in result["config"]


def format_table(result: dict) -> str:
    """The markdown table: per shape its sizes, each column's microseconds and the ratio."""
    cfg = result["config"]
    what = "forward + backward" if cfg["backward"] else "forward"
    title = bench.run_line(result) + "\n" + bench._wrap(
        f"{what}, {cfg['dtype']}, median microseconds per call over {cfg['repeats']} calls; pad: key padding "
        f"(lengths N, N/2, N/4, 3N/4 by batch item) as a bool mask; x best sdpa = the fastest SDPA backend's "
        f"time / fusedattn's (> 1: fusedattn is faster)")
    names = result["methods"]
    header = ["shape", "B", "H", "N", "d", "pad"] + [bench.short_name(m) for m in names] + ["x best sdpa"]
    lines = [[row["shape"], str(row["batch"]), str(row["heads"]), str(row["seqlen"]), str(row["head_dim"]),
              "yes" if row["key_padding"] else "no"]
             + [bench.cell(row["results"][m], lambda r: bench.fmt3(r["us"])) if m in row["results"] else "-"
                for m in names]
             + [bench.fmt_ratio(row["fusedattn_over_best_sdpa"]) if row["fusedattn_over_best_sdpa"] else "-"]
             for row in result["rows"]]
    return title + "\n\n" + bench.markdown_table(header, lines)
