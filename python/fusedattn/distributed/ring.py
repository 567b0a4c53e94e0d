"""Ring attention: exact attention over a sequence split across the ranks of a group.

Each rank keeps its queries and passes its key/value shard around the ring
(rank r sends to r + 1 and receives from r - 1), so after W steps every query
shard has met every key shard. The transfer of the next shard is posted before
the attention of the shard in hand, so the two overlap. Partial results merge
exactly through their log-sum-exp. The backward runs the same ring with the
saved output and log-sum-exp (each block's gradients are then exact), and the
gradients of each key/value shard travel with it, in float32, back to its owner.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from .. import backends
from .layout import rank_and_world, check_layout

__all__ = ["ring_attention"]

# Tags keep the key/value shards and the gradients travelling with them apart
# where the backend matches messages by tag (gloo); NCCL matches them in order,
# which every rank keeps the same.
KV_TAG, GRAD_TAG = 1, 2


@dataclasses.dataclass(frozen=True)
class Block:
    """What one step computes: rows of the local queries against rows of the held key/value shard."""

    q: slice
    kv: slice
    causal: bool


def step_block(rank: int, source: int, n: int, layout: str, is_causal: bool) -> Block | None:
    """The block rank computes against the shard that source holds (None: every key hidden).

    With a causal mask, contiguous shards of earlier ranks are fully visible and
    those of later ranks hidden. A zigzag shard is an early chunk then a late one:
    against an earlier rank's shard every query sees its early chunk only;
    against a later rank's, only the late queries see it, all of it."""
    everything = slice(0, n)
    if not is_causal:
        return Block(everything, everything, False)
    if source == rank:
        return Block(everything, everything, True)
    if layout == "contiguous":
        return Block(everything, everything, False) if source < rank else None
    half = n // 2
    if source < rank:
        return Block(everything, slice(0, half), False)
    return Block(slice(half, n), everything, False)


class _Transfer:
    """Tensors sent to the next rank while the previous rank's arrive."""

    def __init__(self, ring: "Ring", tensors: tuple[Tensor, ...], tag: int):
        if ring.world == 1:
            self._received, self._requests = tensors, []
            return
        self._received = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors)
        ops = [dist.P2POp(dist.isend, t.contiguous(), ring.next, ring.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, ring.prev, ring.group, tag) for t in self._received]
        self._requests = dist.batch_isend_irecv(ops)

    def wait(self) -> tuple[Tensor, ...]:
        for request in self._requests:
            request.wait()
        return self._received


class Ring:
    """A group's ranks in a ring: this rank, its neighbours (as global ranks), the size."""

    def __init__(self, group=None):
        self.group = group
        self.rank, self.world = rank_and_world(group)

        def global_rank(r: int) -> int:
            return r if group is None else dist.get_global_rank(group, r)

        self.next = global_rank((self.rank + 1) % self.world)
        self.prev = global_rank((self.rank - 1) % self.world)

    def pass_on(self, tensors: tuple[Tensor, ...], tag: int) -> _Transfer:
        return _Transfer(self, tensors, tag)


def _merge(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> None:
    """out, lse (float32, in place) become the attention over both key sets."""
    merged = torch.logaddexp(lse, part_lse)
    pivot = merged.masked_fill(torch.isneginf(merged), 0)  # rows that see nothing yet: both weights 0
    out.mul_(torch.exp(lse - pivot).unsqueeze(-1)).add_(part_out.float() * torch.exp(part_lse - pivot).unsqueeze(-1))
    lse.copy_(merged)


def ring_forward(ring: Ring, q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None, layout: str,
                 family: str | None, communicate: bool = True) -> tuple[Tensor, Tensor]:
    """(out, lse) of the local queries against the whole sequence. communicate=False
    keeps the own shard at every step: the same computation without transfers
    (what the benchmark times as compute alone)."""
    n = q.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    kv = (k, v)
    for step in range(ring.world):
        source = (ring.rank - step) % ring.world
        transfer = ring.pass_on(kv, KV_TAG) if communicate and step < ring.world - 1 else None
        block = step_block(ring.rank, source, n, layout, is_causal)
        if block is not None:
            part_out, part_lse = torch.ops.fusedattn.forward(
                q[:, :, block.q], kv[0][:, :, block.kv], kv[1][:, :, block.kv], None, block.causal, scale, family,
                None)
            _merge(out[:, :, block.q], lse[:, :, block.q], part_out, part_lse)
        if transfer is not None:
            kv = transfer.wait()
    return out.to(q.dtype), lse


def ring_backward(ring: Ring, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  is_causal: bool, scale: float | None, layout: str, family: str | None,
                  communicate: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of the local q, k and v. The gradient of each key/value shard
    collects every rank's contribution on its way around the ring and arrives
    at its owner after the last step."""
    n = q.shape[2]
    grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = (k, v)
    incoming = None  # the gradients collected so far for the shard held next
    for step in range(ring.world):
        source = (ring.rank - step) % ring.world
        transfer = ring.pass_on(kv, KV_TAG) if communicate and step < ring.world - 1 else None
        grad_kv = tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv)
        block = step_block(ring.rank, source, n, layout, is_causal)
        if block is not None:
            part_q, part_k, part_v, _ = torch.ops.fusedattn.backward(
                grad_out[:, :, block.q], q[:, :, block.q], kv[0][:, :, block.kv], kv[1][:, :, block.kv],
                out[:, :, block.q], lse[:, :, block.q], None, block.causal, scale, family, None)
            grad_q[:, :, block.q] += part_q
            grad_kv[0][:, :, block.kv] += part_k
            grad_kv[1][:, :, block.kv] += part_v
        if incoming is not None:
            grad_kv = tuple(mine + theirs for mine, theirs in zip(grad_kv, incoming.wait()))
        incoming = ring.pass_on(grad_kv, GRAD_TAG) if communicate else None
        if transfer is not None:
            kv = transfer.wait()
    grad_k, grad_v = incoming.wait() if incoming is not None else grad_kv
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, ring, layout, family):
        out, lse = ring_forward(ring, q, k, v, is_causal, scale, layout, family)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (is_causal, scale, layout, family)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        is_causal, scale, layout, family = ctx.options
        grads = ring_backward(ctx.ring, grad_out.contiguous(), q, k, v, out, lse, is_causal, scale, layout, family)
        return grads + (None,) * 5


def check_shards(q: Tensor, k: Tensor, v: Tensor, layout: str) -> None:
    """The ring's own conditions (the operators check the rest: dtypes, heads, devices)."""
    check_layout(layout, "fusedattn.distributed.ring_attention")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"fusedattn.distributed.ring_attention: {name} must be 4-D [B, H, N/W, d], "
                             f"got shape {list(t.shape)}")
    if not q.shape[2] == k.shape[2] == v.shape[2]:
        raise ValueError("fusedattn.distributed.ring_attention: q, k and v must hold the same positions of the "
                         f"sequence (equal shard lengths, dim 2), got {q.shape[2]}, {k.shape[2]} and {v.shape[2]}")
    if v.shape[3] != q.shape[3]:
        raise ValueError("fusedattn.distributed.ring_attention: v must have the head dim of q and k on the ring "
                         f"(a value head dim of its own runs without context_parallel), got {q.shape[3]} and "
                         f"{v.shape[3]}")
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError("fusedattn.distributed.ring_attention: a zigzag shard is two equal chunks; its length "
                         f"must be even, got {q.shape[2]}")


# Shard descriptions every rank of a group has agreed on (group, description).
_AGREED: set[tuple[int, tuple]] = set()


def check_ranks_agree(ring: Ring, q: Tensor, k: Tensor, v: Tensor, layout: str) -> None:
    """Every rank must hold shards of the same shapes and dtype: a mismatch
    would leave NCCL waiting on messages of another size. Checked once per
    group and description (two small all-reduces), not on every call."""
    codes = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
    mine = (*q.shape, *k.shape, codes.get(q.dtype, 3), codes.get(k.dtype, 3), codes.get(v.dtype, 3),
            len(layout))
    key = (id(ring.group), mine)
    if ring.world == 1 or key in _AGREED:
        return
    low = torch.tensor(mine, dtype=torch.int64, device=q.device)
    high = low.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=ring.group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=ring.group)
    if not torch.equal(low, high):
        raise ValueError("fusedattn.distributed.ring_attention: the ranks' shards differ (q, k shapes, the "
                         f"dtypes or the layout); this rank has q {list(q.shape)}, k {list(k.shape)}, {q.dtype}, "
                         f"layout {layout!r}")
    _AGREED.add(key)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, scale: float | None = None,
                   group=None, layout: str = "contiguous") -> Tensor:
    """Exact attention over a sequence sharded along dim 2 across ``group``'s ranks.

    Args:
        q: ``[B, Hq, N/W, d]``, this rank's queries; k, v: ``[B, Hkv, N/W, d]``
            (``Hq % Hkv == 0``). Every rank holds shards of the same length.
        is_causal: a causal mask over the global positions (``Nq == Nk``).
        scale: multiplies ``q @ k^T``; defaults to ``1 / sqrt(d)``.
        group: the process group (default: the world).
        layout: how positions are spread over the ranks, ``"contiguous"`` or
            ``"zigzag"`` (:mod:`fusedattn.distributed.layout`; ``shard`` makes either).

    Returns:
        ``[B, Hq, N/W, d]``: this rank's rows of the attention output,
        differentiable with respect to q, k and v. Every rank of the group must
        make the same calls in the same order.
    """
    check_shards(q, k, v, layout)
    ring = Ring(group)
    check_ranks_agree(ring, q, k, v, layout)
    return _RingAttention.apply(q, k, v, is_causal, scale, ring, layout, backends.forced().family)
