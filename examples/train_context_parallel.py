"""Train a small transformer language model context-parallel: each of W
processes holds 1/W of every sequence, and the model's unchanged
fusedattn.attention calls run as ring attention inside
fusedattn.distributed.context_parallel. The same model trained in one process
from the same seed gives the same loss curve.

    python examples/train_context_parallel.py [--world 2] [--steps 60]        # gloo on the CPU
    torchrun --nproc-per-node 2 examples/train_context_parallel.py --device cuda  # NCCL, one GPU each

Per step each rank computes the loss of its own tokens; the parameter
gradients are averaged over the ranks (as data-parallel training would), which
gives the gradient of the whole sequence's mean loss because every rank holds
as many tokens. Positions are global: fusedattn.distributed.positions says
which a rank's rows are (with the zigzag layout they are not contiguous).
"""

import argparse
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import fusedattn
from fusedattn import distributed as fd

VOCAB, SEQ, BATCH, WIDTH, HEADS, LAYERS = 64, 240, 8, 64, 4, 2  # SEQ: a multiple of 2W up to W=8


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(SEQ, WIDTH)
        self.qkv = nn.ModuleList(nn.Linear(WIDTH, 3 * WIDTH) for _ in range(LAYERS))
        self.out = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
                                 for _ in range(LAYERS))
        self.norm = nn.ModuleList(nn.LayerNorm(WIDTH) for _ in range(2 * LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, positions):
        x = self.embed(ids) + self.position(positions)
        b, n, _ = x.shape
        for i in range(LAYERS):
            q, k, v = self.qkv[i](self.norm[2 * i](x)).view(b, n, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
            dtype = torch.bfloat16 if x.is_cuda else x.dtype  # fusedattn's CUDA kernels take 16-bit inputs
            attn = fusedattn.attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True).to(x.dtype)
            x = x + self.out[i](attn.transpose(1, 2).reshape(b, n, WIDTH))
            x = x + self.mlp[i](self.norm[2 * i + 1](x))
        return self.head(x)


def batch_of_patterns(generator: torch.Generator) -> torch.Tensor:
    """Sequences repeating a random pattern of 3 to 8 tokens: predictable only by attending back."""
    rows = []
    for _ in range(BATCH):
        period = int(torch.randint(3, 9, (1,), generator=generator))
        pattern = torch.randint(0, VOCAB, (period,), generator=generator)
        rows.append(pattern.repeat(SEQ // period + 2)[: SEQ + 1])
    return torch.stack(rows)


def train(args, device: torch.device, parallel: bool) -> list[float]:
    """The loss of every step; parallel: this rank's part of a context-parallel run."""
    torch.manual_seed(args.seed)
    model = TinyLM().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(args.seed)
    world = dist.get_world_size() if parallel else 1
    losses = []
    for _ in range(args.steps):
        ids = batch_of_patterns(data).to(device)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        positions = torch.arange(SEQ, device=device)
        if parallel:  # this rank's tokens and where they sit in the sequence
            inputs, targets = (fd.shard(t, 1, layout=args.layout) for t in (inputs, targets))
            positions = fd.positions(inputs.shape[1], dist.get_rank(), world, args.layout, device=device)
            with fd.context_parallel(layout=args.layout):
                logits = model(inputs, positions)
        else:
            logits = model(inputs, positions)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        if parallel:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world
        optimizer.step()
        losses.append(loss.item())
    return losses


def report(args, parallel: list[float], alone: list[float], world: int) -> None:
    every = max(1, args.steps // 8)
    print(f"{args.steps} steps, {world} processes ({args.layout} layout) against one, loss every {every} steps")
    print(f"{'step':>5} {'context-parallel':>17} {'one process':>12}")
    for step in range(0, args.steps, every):
        print(f"{step:5d} {parallel[step]:17.4f} {alone[step]:12.4f}")
    print(f"last loss {parallel[-1]:.4f} (one process {alone[-1]:.4f}, uniform guessing {math.log(VOCAB):.4f}); "
          f"largest difference along the way {max(abs(a - b) for a, b in zip(parallel, alone)):.2e}")


def run(rank: int, world: int, args, store: str | None) -> None:
    """One process of the context-parallel run (spawned, or started by torchrun: store None)."""
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if store is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        parallel = train(args, device, parallel=True)
        if dist.get_rank() == 0:
            report(args, parallel, train(args, device, parallel=False), dist.get_world_size())
        # Every rank leaves together: a gloo peer torn down while rank 0 still
        # trains alone can abort the spawned processes.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="processes to spawn (without torchrun)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layout", choices=fd.LAYOUTS, default="zigzag")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if "RANK" in os.environ:  # torchrun started this process
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return
    if args.device != "cpu":
        parser.error("spawned processes run on the CPU; start CUDA runs with torchrun, one process per GPU")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(args.world, args, os.path.join(tmp, "store")), nprocs=args.world)


if __name__ == "__main__":
    main()
