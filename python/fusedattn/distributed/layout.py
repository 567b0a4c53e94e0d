"""How a sequence is split over the ranks of a context-parallel group.

``contiguous``: the sequence is cut into W equal chunks and rank r holds chunk r.
``zigzag``: it is cut into 2W equal chunks and rank r holds chunks r and
2W - 1 - r, one after the other, so under a causal mask every rank has the same
work (an early chunk that sees little and a late one that sees much).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["LAYOUTS", "check_layout", "chunks", "positions", "shard", "unshard"]

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str, caller: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{caller}: layout must be one of {LAYOUTS}, got {layout!r}")


def chunks(rank: int, world: int, layout: str) -> tuple[int, tuple[int, ...]]:
    """(how many equal chunks the sequence is cut into, the ones rank holds, in order)."""
    check_layout(layout, "fusedattn.distributed.chunks")
    if layout == "contiguous":
        return world, (rank,)
    return 2 * world, (rank, 2 * world - 1 - rank)


def positions(local_len: int, rank: int, world: int, layout: str, device=None) -> Tensor:
    """The global positions of the rows rank holds (int64 ``[local_len]``): what
    a model adds as position ids (RoPE, learned positions) to a sharded input."""
    count, held = chunks(rank, world, layout)
    if local_len % len(held):
        raise ValueError(f"fusedattn.distributed.positions: a {layout} shard holds {len(held)} equal chunks; "
                         f"its length must be a multiple of {len(held)}, got {local_len}")
    size = local_len // len(held)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in held])


def rank_and_world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fusedattn.distributed: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first (torchrun sets up its environment)")
    return dist.get_rank(group), dist.get_world_size(group)


def shard(x: Tensor, dim: int, group=None, layout: str = "contiguous") -> Tensor:
    """This rank's shard of ``x``, the whole sequence (the same on every rank),
    along ``dim``. Differentiable (a view or a concatenation of views)."""
    check_layout(layout, "fusedattn.distributed.shard")
    rank, world = rank_and_world(group)
    count, held = chunks(rank, world, layout)
    n = x.shape[dim]
    if n % count:
        raise ValueError(f"fusedattn.distributed.shard: a {layout} layout over {world} ranks cuts dim {dim} into "
                         f"{count} equal chunks; its length must be a multiple of {count}, got {n}")
    size = n // count
    parts = [x.narrow(dim, c * size, size) for c in held]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(x: Tensor, dim: int, group=None, layout: str = "contiguous") -> Tensor:
    """The whole sequence from every rank's shard ``x`` along ``dim`` (an
    all-gather; every rank gets the result). Not differentiable."""
    check_layout(layout, "fusedattn.distributed.unshard")
    rank, world = rank_and_world(group)
    count, held = chunks(rank, world, layout)
    if x.shape[dim] % len(held):
        raise ValueError(f"fusedattn.distributed.unshard: a {layout} shard holds {len(held)} equal chunks; "
                         f"dim {dim} must be a multiple of {len(held)}, got {x.shape[dim]}")
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x.contiguous(), group=group)
    pieces: list[Tensor | None] = [None] * count
    for r, part in enumerate(gathered):
        for c, piece in zip(chunks(r, world, layout)[1], part.chunk(len(held), dim)):
            pieces[c] = piece
    return torch.cat(pieces, dim)
