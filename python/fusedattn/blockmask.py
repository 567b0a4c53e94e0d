"""fusedattn.BlockMask: a boolean attention mask built once (its mask_mod
evaluated once) and reused across layers and steps, from a FlexAttention-style
``mask_mod`` or from a dense mask. The kernels skip the tiles it hides and read
none of it on the tiles it leaves whole; on CUDA each call sorts it into the
serving kernel's tiles in one pass over it (``plan(...)["mask_tiles"]``), so it
has no tile size of its own."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

# Entries of one mask_mod evaluation at most (its index arithmetic makes int64
# temporaries of this size): larger masks are evaluated a band of rows at a time.
_CHUNK_ENTRIES = 1 << 26


class BlockMask:
    """A bool mask ``[B or 1, H or 1, Nq or 1, Nk or 1]`` (True = may attend)
    for :func:`fusedattn.attention`'s ``attn_mask``. A dimension of size 1 is
    the same for every batch item, head, query (a key padding mask) or key.
    Build one with :func:`block_mask` or :meth:`from_dense`."""

    def __init__(self, mask: Tensor):
        if mask.dtype != torch.bool or mask.dim() != 4:
            raise TypeError(f"fusedattn.BlockMask: expected a 4-d bool tensor, got {mask.dim()}-d {mask.dtype}")
        self.mask = mask

    @classmethod
    def from_dense(cls, mask: Tensor) -> BlockMask:
        """From a dense bool mask broadcastable to ``[B, H, Nq, Nk]`` (at most 4-d,
        at least 2-d: ``[Nq, Nk]``). Dimensions of size 1 stay broadcast; nothing
        is copied when the mask is already 4-d."""
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(f"fusedattn.BlockMask.from_dense: expected a bool tensor, got {got}")
        if not 2 <= mask.dim() <= 4:
            raise ValueError(f"fusedattn.BlockMask.from_dense: expected [Nq, Nk] up to [B, H, Nq, Nk], got shape "
                             f"{list(mask.shape)}")
        return cls(mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)))

    @property
    def shape(self) -> tuple[int | None, int | None, int, int]:
        """``(B, H, Nq, Nk)`` as held: B or H None where the mask is the same for every batch
        item or head, Nq or Nk 1 where it is the same for every query or key."""
        b, h, nq, nk = self.mask.shape
        return (b if b > 1 else None, h if h > 1 else None, nq, nk)

    def to_dense(self) -> Tensor:
        """The mask as a bool tensor ``[B or 1, H or 1, Nq, Nk]``."""
        return self.mask

    def for_call(self, q: Tensor, k: Tensor) -> Tensor:
        """The mask for attention (or its plan) of q ``[B, Hq, Nq, d]`` over k
        ``[B, Hkv, Nk, d]``; raises ValueError naming what differs."""
        b, h, nq, nk = self.mask.shape
        want = {"batch": (b, q.shape[0]), "heads": (h, q.shape[1]), "Nq": (nq, q.shape[2]), "Nk": (nk, k.shape[2])}
        for name, (mine, call) in want.items():
            if mine not in (call, 1):  # a size of 1 broadcasts
                raise ValueError(f"fusedattn: the BlockMask has {name} {mine}, the call has {call} "
                                 f"(BlockMask shape {list(self.mask.shape)}, q {list(q.shape)}, k {list(k.shape)})")
        if self.mask.device != q.device:
            raise ValueError(f"fusedattn: the BlockMask is on {self.mask.device}, q on {q.device}")
        return self.mask

    def __repr__(self) -> str:
        b, h, nq, nk = self.shape
        visible = self.mask.count_nonzero().item() / max(1, self.mask.numel())
        return (f"BlockMask(B={b}, H={h}, Nq={nq}, Nk={nk}, visible={visible:.3f}, "
                f"device={self.mask.device})")


def block_mask(mask_mod: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], B: int | None, H: int | None, Nq: int,
               Nk: int, device: torch.device | str | None = None) -> BlockMask:
    """The BlockMask of ``mask_mod(b, h, q_idx, kv_idx)``: a vectorised predicate
    over int64 index tensors (broadcast against each other) returning a bool
    tensor, True where query ``q_idx`` of head ``h`` of batch item ``b`` may see
    key ``kv_idx``. ``B`` or ``H`` None: the same for every batch item or head
    (FlexAttention's ``create_block_mask`` convention). Memory: one byte per
    entry of ``[B or 1, H or 1, Nq, Nk]``, less where the result does not
    depend on an index (its broadcast shape keeps a 1 there): a key padding mask
    ``kv_idx < lengths[b]`` is held as ``[B, 1, 1, Nk]``, which the kernels read
    as one row."""
    for name, value in (("B", B), ("H", H)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"fusedattn.block_mask: {name} must be a positive int or None, got {value!r}")
    for name, value in (("Nq", Nq), ("Nk", Nk)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"fusedattn.block_mask: {name} must be an int >= 0, got {value!r}")
    b_size, h_size = B or 1, H or 1
    device = torch.device(device) if device is not None else torch.empty(0).device
    b = torch.arange(b_size, device=device).view(-1, 1, 1, 1)
    h = torch.arange(h_size, device=device).view(1, -1, 1, 1)
    kv = torch.arange(Nk, device=device).view(1, 1, 1, -1)
    rows = max(2, _CHUNK_ENTRIES // max(1, b_size * h_size * Nk))  # 2: a result of one row then means no q_idx

    def evaluate(r0: int, r1: int) -> Tensor:
        """mask_mod over queries [r0, r1), 4-d, in the shape it broadcasts to."""
        part = mask_mod(b, h, torch.arange(r0, r1, device=device).view(1, 1, -1, 1), kv)
        if not isinstance(part, Tensor) or part.dtype != torch.bool:
            got = part.dtype if isinstance(part, Tensor) else type(part).__name__
            raise TypeError(f"fusedattn.block_mask: mask_mod must return a bool tensor, got {got}")
        want = torch.Size([b_size, h_size, r1 - r0, Nk])
        try:
            fits = part.dim() <= 4 and torch.broadcast_shapes(part.shape, want) == want
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"fusedattn.block_mask: mask_mod returned shape {list(part.shape)}, which does not "
                             f"broadcast to {list(want)}")
        return part.reshape((1,) * (4 - part.dim()) + tuple(part.shape))

    first = evaluate(0, min(Nq, rows))
    if first.shape[2] == 1:  # the same for every query: one row stands for all
        return BlockMask(first.contiguous())
    mask = torch.empty(first.shape[0], first.shape[1], Nq, first.shape[3], dtype=torch.bool, device=device)
    mask[:, :, :first.shape[2]] = first
    for r0 in range(first.shape[2], Nq, rows):
        mask[:, :, r0:min(Nq, r0 + rows)] = evaluate(r0, min(Nq, r0 + rows))
    return BlockMask(mask)
