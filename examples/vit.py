"""A Vision Transformer (ViT-B/16's shape by default: 197 tokens, 12 heads of
64) with its attention on fusedattn and on PyTorch's SDPA, the same weights:
milliseconds per batch of a forward and of a training step (AdamW), eager and
under torch.compile, median over --repeats batches after warm-up.

    python examples/vit.py [--device cuda] [--batch 128] [--no-compile]
    python examples/vit.py --device cpu --depth 2 --batch 8   # a quick look on a CPU

It exits with status 1 if the two attentions' logits differ by more than
float32's (or on CUDA bfloat16's) rounding allows.
"""

import argparse
import copy
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusedattn

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--batch", type=int, default=128)
parser.add_argument("--image", type=int, default=224, help="image side in pixels")
parser.add_argument("--patch", type=int, default=16)
parser.add_argument("--dim", type=int, default=768)
parser.add_argument("--heads", type=int, default=12)
parser.add_argument("--depth", type=int, default=12)
parser.add_argument("--repeats", type=int, default=20, help="timed batches per cell; the median is printed")
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--no-compile", action="store_true", dest="no_compile", help="eager only")
args = parser.parse_args()
for name in ("batch", "image", "patch", "dim", "heads", "depth", "repeats"):
    if getattr(args, name) < 1:
        parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
if args.image % args.patch or args.dim % args.heads:
    parser.error(f"--image {args.image} must be a multiple of --patch {args.patch}, and --dim {args.dim} "
                 f"of --heads {args.heads}")
device = torch.device(args.device)
on_cuda = device.type == "cuda"
dtype = torch.bfloat16 if on_cuda else torch.float32  # autocast's dtype on CUDA


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, attend):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.proj(self.attend(q, k, v).transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, attend):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, attend)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, attend, classes: int = 1000):
        super().__init__()
        tokens = (args.image // args.patch) ** 2 + 1
        self.patches = nn.Conv2d(3, args.dim, args.patch, stride=args.patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, args.dim))
        self.pos = nn.Parameter(torch.randn(1, tokens, args.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(args.dim, args.heads, attend) for _ in range(args.depth))
        self.norm, self.head = nn.LayerNorm(args.dim), nn.Linear(args.dim, classes)

    def forward(self, images):
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


ATTENTION = {"sdpa": F.scaled_dot_product_attention, "fusedattn": fusedattn.attention}


def milliseconds(step) -> float:
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.repeats):
        if on_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if on_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


torch.manual_seed(0)
reference = ViT(ATTENTION["sdpa"]).to(device)
images = torch.randn(args.batch, 3, args.image, args.image, device=device)
labels = torch.randint(0, 1000, (args.batch,), device=device)
autocast = lambda: torch.autocast(device.type, dtype=dtype, enabled=on_cuda)  # noqa: E731

logits, results = {}, {}
for impl, attend in ATTENTION.items():
    model = copy.deepcopy(reference)
    for block in model.blocks:
        block.attn.attend = attend
    with torch.no_grad(), autocast():
        logits[impl] = model(images).float()
    for mode in ["eager"] + ([] if args.no_compile else ["compiled"]):
        run = torch.compile(model) if mode == "compiled" else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def forward():
            with torch.no_grad(), autocast():
                run(images)

        def train_step():
            with autocast():
                loss = F.cross_entropy(run(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        results[(impl, mode)] = (milliseconds(forward), milliseconds(train_step))

tokens = (args.image // args.patch) ** 2 + 1
print(f"ViT: {args.depth} layers, {args.heads} heads of {args.dim // args.heads}, {tokens} tokens, batch "
      f"{args.batch}, {device.type} ({'bfloat16 autocast' if on_cuda else 'float32'}), median ms of {args.repeats}")
print(f"{'mode':9} {'attention':10} {'forward':>9} {'train step':>11}")
for (impl, mode), (fwd, step) in results.items():
    print(f"{mode:9} {impl:10} {fwd:9.2f} {step:11.2f}")
for mode in dict.fromkeys(mode for _, mode in results):
    (f_fwd, f_step), (s_fwd, s_step) = results[("fusedattn", mode)], results[("sdpa", mode)]
    print(f"{mode}: fusedattn's time / SDPA's: forward {f_fwd / s_fwd:.2f}, train step {f_step / s_step:.2f}")
difference = (logits["fusedattn"] - logits["sdpa"]).abs().max().item()
scale = logits["sdpa"].abs().max().item()
print(f"max |logits fusedattn - sdpa| = {difference:.2e} (largest logit {scale:.2e})")
tolerance = (2e-2 if on_cuda else 1e-4) * max(scale, 1.0)
if not difference <= tolerance:
    raise SystemExit(f"the logits differ by more than {tolerance:.1e}")
