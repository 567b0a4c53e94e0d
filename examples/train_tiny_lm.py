"""Train a small transformer language model with fusedattn and with PyTorch's
SDPA from the same seed, and compare the two loss curves.

    python examples/train_tiny_lm.py [--device cuda] [--steps 300]

The data are synthetic: sequences that repeat a random pattern of 3 to 8
tokens, so the model can only predict well by attending back one period. On
CUDA the attention inputs are bfloat16 (fusedattn's CUDA kernels take 16-bit
inputs), the rest float32; on the CPU everything is float32.
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

import fusedattn

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
VOCAB, SEQ, BATCH, WIDTH, HEADS, LAYERS = 64, 128, 16, 128, 4, 2


def batch_of_patterns(generator: torch.Generator) -> torch.Tensor:
    rows = []
    for _ in range(BATCH):
        period = int(torch.randint(3, 9, (1,), generator=generator))
        pattern = torch.randint(0, VOCAB, (period,), generator=generator)
        rows.append(pattern.repeat(SEQ // period + 2)[: SEQ + 1])
    return torch.stack(rows)


class Block(nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.attend = attend
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        dtype = torch.bfloat16 if x.is_cuda else x.dtype
        attn = self.attend(q.to(dtype), k.to(dtype), v.to(dtype)).to(x.dtype)
        x = x + self.out(attn.transpose(1, 2).reshape(b, n, WIDTH))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.randn(SEQ, WIDTH) / math.sqrt(WIDTH))
        self.blocks = nn.ModuleList(Block(attend) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(attend) -> list[float]:
    torch.manual_seed(args.seed)
    model = TinyLM(attend).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(args.seed)
    losses = []
    for _ in range(args.steps):
        ids = batch_of_patterns(data).to(args.device)
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


implementations = {
    "fusedattn": lambda q, k, v: fusedattn.attention(q, k, v, is_causal=True),
    "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
}
curves = {name: train(attend) for name, attend in implementations.items()}
print(f"{args.device}: {args.steps} steps, loss every {max(1, args.steps // 10)} steps")
print(f"{'step':>5} {'fusedattn':>10} {'sdpa':>10}")
for step in range(0, args.steps, max(1, args.steps // 10)):
    print(f"{step:5d} {curves['fusedattn'][step]:10.4f} {curves['sdpa'][step]:10.4f}")
last = slice(-max(1, args.steps // 10), None)
mean = {name: sum(c[last]) / len(c[last]) for name, c in curves.items()}
print(f"mean loss over the last {len(curves['sdpa'][last])} steps: fusedattn {mean['fusedattn']:.4f}, "
      f"sdpa {mean['sdpa']:.4f}; largest difference along the way "
      f"{max(abs(a - b) for a, b in zip(*curves.values())):.4f} (uniform guessing: {math.log(VOCAB):.4f})")
