"""`fusedattn bench --train MODEL`: training steps of a decoder-only transformer
whose attention is fusedattn's or one of SDPA's backends, everything else the
same: tokens per second, peak memory, and the loss curves from one seed.

Each method gets its own copy of the model, built from the same seed, and the
same batches; its steps (forward, backward, AdamW) interleave with the other
methods' (bench.interleaved_medians), so every method's loss curve is its own
run from the same start. The batches repeat a random block of tokens along
the sequence, which attention can learn to copy, so the losses fall.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import fusedattn

from . import bench
from .memory import peak_bytes


@dataclasses.dataclass(frozen=True)
class ModelShape:
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seqlen: int
    batch: int
    period: int  # the batches' repeated block of tokens
    lr: float  # AdamW's, after a linear warm-up over the run's warm-up steps


# gpt2: GPT-2 small's shape; llama: four Llama-3-8B-shaped blocks (GQA 32/8, head dim 128); tiny: tests.
MODELS = {
    "gpt2": ModelShape(layers=12, d_model=768, heads=12, kv_heads=12, ffn=3072, vocab=50304, seqlen=4096,
                       batch=8, period=256, lr=6e-4),
    "llama": ModelShape(layers=4, d_model=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, seqlen=8192,
                        batch=1, period=512, lr=1e-4),
    "tiny": ModelShape(layers=2, d_model=64, heads=4, kv_heads=2, ffn=128, vocab=97, seqlen=64, batch=2,
                       period=8, lr=1e-3),
}


DATA_VOCAB = 1024


@dataclasses.dataclass
class TrainConfig:
    """What `fusedattn bench --train` times; cli._bench_train sets its fields."""
    device: torch.device
    model: str
    dtypes: list[str]  # one (the command line refuses more): autocast's, or float32
    repeats: int  # timed steps per method
    warmup: int  # steps before the timed ones (compilation happens there)
    compile: bool
    methods: list[str]
    seed: int = 0


def default_config(device: torch.device, model: str) -> TrainConfig:
    if device.type == "cuda":
        return TrainConfig(device, model, ["bfloat16"], repeats=200, warmup=10, compile=True,
                           methods=["fusedattn", "sdpa-cudnn", "sdpa-flash"])
    return TrainConfig(device, model, ["float32"], repeats=5, warmup=1, compile=False, methods=["fusedattn", "sdpa"])


def method_names(device: torch.device) -> list[str]:
    return ["fusedattn", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient"] if device.type == "cuda" else ["fusedattn",
                                                                                                      "sdpa"]


def attention_of(method: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Causal attention of [B, H, N, d] q and [B, Hkv, N, d] k, v: fusedattn's, or SDPA's held to
    the method's backend inside the function: torch.compile guards on the closure's backend, not
    on a context entered around the compiled model, whose graph the next SDPA column would reuse."""
    if method == "fusedattn":
        return lambda q, k, v: fusedattn.attention(q, k, v, is_causal=True)
    backend = method.removeprefix("sdpa-") if method != "sdpa" else None

    def sdpa(q, k, v):
        with bench.sdpa_kernel_of(backend) if backend else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])

    return sdpa


class Block(nn.Module):
    """Pre-norm attention (rotary positions, grouped-query) and a SwiGLU MLP."""

    def __init__(self, s: ModelShape, attention):
        super().__init__()
        self.s, self.attention, self.head_dim = s, attention, s.d_model // s.heads
        self.norm1, self.norm2 = nn.RMSNorm(s.d_model), nn.RMSNorm(s.d_model)
        self.qkv = nn.Linear(s.d_model, (s.heads + 2 * s.kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(s.d_model, s.d_model, bias=False)
        self.up = nn.Linear(s.d_model, 2 * s.ffn, bias=False)
        self.down = nn.Linear(s.ffn, s.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, -1, self.head_dim).transpose(1, 2).split(
            [self.s.heads, self.s.kv_heads, self.s.kv_heads], dim=1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        x = x + self.out(self.attention(q, k, v).transpose(1, 2).reshape(b, n, -1))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions, in x's dtype (the attention's inputs share one)."""
    half = x.shape[-1] // 2
    return (x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin).to(x.dtype)


class Model(nn.Module):
    def __init__(self, s: ModelShape, attention):
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.d_model)
        self.blocks = nn.ModuleList(Block(s, attention) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)  # GPT-2's: the tied head's logits start small
        d = s.d_model // s.heads
        angles = torch.arange(s.seqlen)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, dim=-1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.norm(x) @ self.embed.weight.T  # tied head
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def batches(s: ModelShape, steps: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    """Token batches [B, N], each row a random block of s.period tokens repeated. The tokens are
    the first DATA_VOCAB ids, so the loss falls from about ln(vocab) within the warm-up; copying
    the block takes it lower."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        block = torch.randint(0, min(s.vocab, DATA_VOCAB), (s.batch, s.period), generator=g)
        out.append(block.repeat(1, math.ceil(s.seqlen / s.period))[:, :s.seqlen].to(device))
    return out


class Trainer:
    """One method's model, optimizer and the losses of its steps so far."""

    def __init__(self, cfg: TrainConfig, method: str, data: list[torch.Tensor]):
        s = MODELS[cfg.model]
        torch.manual_seed(cfg.seed)
        # float32 weights; a lower dtype is autocast's (mixed precision, as models train).
        self.model = Model(s, attention_of(method)).to(cfg.device)
        self.forward = torch.compile(self.model) if cfg.compile else self.model
        dtype = cfg.dtypes[0]
        self.autocast = torch.autocast(cfg.device.type, bench.DTYPES[dtype], enabled=dtype != "float32")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=s.lr)
        # Warm-up and clipping as models train: without them the llama shape's loss rose and two
        # SDPA backends' curves drifted apart by more than 3.
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda i: min(1.0, (i + 1) / cfg.warmup))
        self.data, self.losses = data, []

    def step(self) -> None:
        with self.autocast:
            loss = self.forward(self.data[len(self.losses)])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.detach())


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(cfg: TrainConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    s = MODELS[cfg.model]
    steps = cfg.warmup + 1 + cfg.repeats  # warm-up, the peak-memory step, the timed ones
    data = batches(s, steps, cfg.device, cfg.seed)
    results, trainers, timed = {}, {}, {}
    for method in cfg.methods:
        try:
            trainer = Trainer(cfg, method, data)
            for _ in range(cfg.warmup):
                trainer.step()
            results[method] = {"status": "ok", "peak_bytes": peak_bytes(trainer.step, cfg.device)}
        except (torch.OutOfMemoryError, RuntimeError, NotImplementedError) as e:
            results[method] = {"status": "OOM"} if isinstance(e, torch.OutOfMemoryError) else bench.not_available(e)
        else:
            trainers[method] = trainer
            timed[method] = lambda t=trainer: bench._time_once(t.step, cfg.device)
            continue
        # Out of the except clause, whose traceback held the failed step's frames: the column's
        # weights and AdamW state go before the next column's are made.
        trainer = None
        _release(cfg.device)
    bar = tqdm(total=cfg.repeats * len(timed), desc="fusedattn bench --train", unit="step", disable=not progress)
    ticking = {m: (lambda f=f: (f(), bar.update())[0]) for m, f in timed.items()}
    medians = bench.interleaved_medians(ticking, cfg.repeats)
    bar.close()
    tokens = s.batch * s.seqlen
    for method, seconds in medians.items():
        if isinstance(seconds, dict):
            results[method] = seconds
            del trainers[method]
            _release(cfg.device)
            continue
        losses = torch.stack(trainers[method].losses).float().tolist()
        results[method].update(seconds=seconds, tokens_per_s=tokens / seconds, losses=losses)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": bench.describe_device(cfg.device),
        "device_type": cfg.device.type,
        "torch": torch.__version__,
        "config": {"train": cfg.model, "shape": dataclasses.asdict(s), "dtype": cfg.dtypes[0], "repeats": cfg.repeats,
                   "warmup": cfg.warmup, "compile": cfg.compile, "seed": cfg.seed},
        "methods": list(cfg.methods),
        "rows": [{"model": cfg.model, "results": results}],  # one model a run
    }


def is_train(result: dict) -> bool:
    """Whether a saved result is `fusedattn bench --train`'s."""
    return "train" in result["config"]


def loss_gap(result: dict, method: str, anchor: str) -> float | None:
    """The largest |loss difference| of two methods at any step (inf where a loss is not finite),
    or None if either did not run."""
    (row,) = result["rows"]
    a, b = row["results"].get(method, {}), row["results"].get(anchor, {})
    if a.get("status") != "ok" or b.get("status") != "ok":
        return None
    if len(a["losses"]) != len(b["losses"]) or not all(map(math.isfinite, a["losses"] + b["losses"])):
        return math.inf
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))


def format_table(result: dict) -> str:
    cfg, s = result["config"], result["config"]["shape"]
    title = bench.run_line(result) + "\n" + bench._wrap(
        f"training steps of {cfg['train']} ({s['layers']} layers, d_model {s['d_model']}, {s['heads']} query / "
        f"{s['kv_heads']} key-value heads, B={s['batch']} N={s['seqlen']}), {cfg['dtype']}, "
        f"{'torch.compile' if cfg['compile'] else 'eager'}, AdamW (float32 weights); median of "
        f"{cfg['repeats']} steps after {cfg['warmup']} (+1 for the peak: a step's memory above the model's "
        f"and AdamW's); x m = m's step time / fusedattn's; loss gap: the largest |loss difference| from "
        f"fusedattn's at any of the {cfg['warmup'] + 1 + cfg['repeats']} steps")
    header = ["method", "step ms", "tokens/s", "peak", "first loss", "last loss", "x", "loss gap"]
    (row,) = result["rows"]
    fa = row["results"].get("fusedattn", {})
    lines = []
    for m in result["methods"]:
        r = row["results"][m]
        if r["status"] != "ok":
            lines.append([m, r["status"]] + ["-"] * 6)
            continue
        ratio = r["seconds"] / fa["seconds"] if m != "fusedattn" and fa.get("status") == "ok" else None
        gap = loss_gap(result, m, "fusedattn") if m != "fusedattn" else None
        lines.append([m, bench.fmt3(r["seconds"] * 1e3), f"{r['tokens_per_s']:.0f}",
                      bench._fmt_bytes(r["peak_bytes"]),
                      f"{r['losses'][0]:.4f}", f"{r['losses'][-1]:.4f}",
                      bench.fmt_ratio(ratio) if ratio else "-", f"{gap:.2e}" if gap is not None else "-"])
    table = title + "\n\n" + bench.markdown_table(header, lines)
    others = [m for m in result["methods"] if m != "fusedattn" and row["results"][m]["status"] == "ok"]
    floor = [loss_gap(result, a, b) for i, a in enumerate(others) for b in others[i + 1:]]
    if floor:  # what the same training reads between two correct attentions: the gaps' scale
        table += f"\n\nloss gap between {', '.join(others)} themselves: {max(floor):.2e}"
    return table
