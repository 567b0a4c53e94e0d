"""What the processes of the ring-attention tests run (tests/test_distributed.py).

Each worker joins a gloo group, runs every case on its shards, gathers the
whole outputs and gradients with fusedattn.distributed.unshard, and rank 0
saves them for the parent to check against the float64 reference.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers.attention_cases import Case, make_inputs

SPAWN_DEADLINE_S = 240  # a world's cases take about 10 s on 2 cores


@dataclasses.dataclass(frozen=True)
class RingCase:
    case: Case  # the whole sequence: seqlen_q == seqlen_k
    layout: str

    def __str__(self) -> str:
        return f"{self.layout}-{self.case}"


def grad_out_of(case: Case) -> torch.Tensor:
    g = torch.Generator().manual_seed(case.seed + 1)
    shape = (case.batch, case.heads_q, case.seqlen_q, case.head_dim)
    return torch.randn(shape, generator=g).to(case.dtype)


def tiny_model(seed: int) -> torch.nn.Module:
    """Two causal fusedattn.nn.MultiheadAttention layers with a projection between."""
    import fusedattn

    torch.manual_seed(seed)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.ModuleList(fusedattn.nn.MultiheadAttention(32, 4, batch_first=True)
                                            for _ in range(2))
            self.mix = torch.nn.Linear(32, 32)

        def forward(self, x):
            hint = torch.ones(1, 1, dtype=torch.bool)  # nn.MultiheadAttention wants a mask with is_causal
            for i, attn in enumerate(self.attn):
                x = x + attn(x, x, x, need_weights=False, attn_mask=hint, is_causal=True)[0]
                if i == 0:
                    x = self.mix(x)
            return x

    return Model()


def model_input(world: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(world)
    n = 2 * world * 21  # 21 rows per zigzag chunk: no tile multiple
    return torch.randn(2, n, 32, generator=g), torch.randn(2, n, 32, generator=g)


def _run_case(rc: RingCase, device: torch.device) -> dict[str, torch.Tensor]:
    from fusedattn import distributed as fd

    c = rc.case
    q, k, v, _ = make_inputs(c, device)
    local = [fd.shard(t, 2, layout=rc.layout).detach().requires_grad_() for t in (q, k, v)]
    out = fd.ring_attention(*local, is_causal=c.is_causal, scale=c.scale, layout=rc.layout)
    out.backward(fd.shard(grad_out_of(c).to(device), 2, layout=rc.layout))
    whole = [out.detach()] + [t.grad for t in local]
    return dict(zip(("out", "dq", "dk", "dv"), (fd.unshard(t, 2, layout=rc.layout).cpu() for t in whole)))


def _run_model(world: int, layout: str, compiled: bool) -> dict[str, torch.Tensor]:
    from fusedattn import distributed as fd

    model = tiny_model(seed=world)
    x, g = model_input(world, layout)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    if compiled:  # compiled outside the block first: entering it must not reuse that graph
        run(fd.shard(x, 1, layout=layout))
        model.zero_grad()
    with fd.context_parallel(layout=layout):
        out = run(fd.shard(x, 1, layout=layout))
    (out * fd.shard(g, 1, layout=layout)).sum().backward()
    result = {"out": fd.unshard(out.detach(), 1, layout=layout)}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)  # each rank's loss covers its own rows: the whole gradient is the sum
        result[name] = p.grad
    return result


def work(rank: int, world: int, store: str, cases: list[RingCase], model_runs: list[tuple[str, bool]],
         result_path: str, device_type: str = "cpu", mismatched_shards: bool = False) -> None:
    """One rank: gloo on the CPU, or NCCL with one GPU per rank (device_type "cuda").
    mismatched_shards: call the ring with a shard one row longer on each later rank."""
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # A lost message fails the test within a minute instead of hanging it.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        import fusedattn  # noqa: F401  (the operators)

        if mismatched_shards:
            from fusedattn import distributed as fd

            q = torch.randn(1, 2, 8 + rank, 16, device=device)
            fd.ring_attention(q, q, q)
        results = {str(rc): _run_case(rc, device) for rc in cases}
        for layout, compiled in model_runs:
            results[f"model-{layout}-{'compiled' if compiled else 'eager'}"] = _run_model(world, layout, compiled)
        if rank == 0:
            torch.save(results, result_path)
        # No rank tears its connections down while a peer may still be using
        # them (a gloo peer left mid-teardown aborted once in CI, on 2 cores).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A rank that did its work leaves without the interpreter's teardown, where
    # gloo's threads have still aborted a rank (std::terminate, in CI on 2 cores).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ring(world: int, tmp, cases: list[RingCase], model_runs, device_type: str = "cpu",
               mismatched_shards: bool = False) -> dict | str:
    """What rank 0 of `world` processes gathered, or why there is nothing."""
    processes = mp.spawn(work, args=(world, str(tmp / "store"), cases, model_runs, str(tmp / "results.pt"),
                                     device_type, mismatched_shards), nprocs=world, join=False)
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    try:
        while not processes.join(timeout=1):
            if time.monotonic() > deadline:
                for p in processes.processes:
                    p.kill()
                return (f"the {world} ring processes did not finish within {SPAWN_DEADLINE_S} s "
                        "(a message that never arrives?)")
    except mp.ProcessRaisedException as e:
        return f"a ring process raised:\n{e}"
    return torch.load(tmp / "results.pt")
