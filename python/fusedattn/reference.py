"""The oracle: naive attention in plain PyTorch (seed 2). It materialises the
Nq x Nk score matrix, so memory grows as N^2; it runs in any dtype, float64
included, and has exactly the semantics of the fused operators."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["attention", "attention_with_lse", "causal_mask", "window_mask"]


def causal_mask(n_q: int, n_k: int, device=None) -> Tensor:
    """Bool ``[Nq, Nk]``, True where query i may see key j: ``j <= i + (Nk - Nq)``."""
    i = torch.arange(n_q, device=device).unsqueeze(1)
    j = torch.arange(n_k, device=device).unsqueeze(0)
    return j <= i + (n_k - n_q)


def window_mask(n_q: int, n_k: int, window: tuple[int, int], device=None) -> Tensor:
    """Bool ``[Nq, Nk]``, True where query i may see key j under ``window = (left, right)``:
    ``i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right``, -1 leaving that side unbounded."""
    widest = n_q + n_k  # a side wider than both sequences bounds nothing (and cannot overflow int64)
    left, right = (side if side < 0 else min(side, widest) for side in window)
    i = torch.arange(n_q, device=device).unsqueeze(1) + (n_k - n_q)
    j = torch.arange(n_k, device=device).unsqueeze(0)
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    return visible


def attention_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Returns ``(out, lse)`` computed in q's dtype (use float64 for an oracle).

    ``lse`` is the natural log of the softmax normaliser of the scaled,
    soft-capped, masked scores (and the sink, where there are sinks); rows
    with every key masked give ``out = 0`` and ``lse = -inf`` (with a sink:
    the sink).
    """
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"Hq ({hq}) must be a multiple of Hkv ({hkv})")
    if hq != hkv:  # grouped-query attention: query head h reads kv head h // (hq // hkv)
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # [B, Hq, Nq, Nk], materialised
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.to(s.dtype)
    if is_causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    if window is not None:
        s = s.masked_fill(~window_mask(q.shape[2], k.shape[2], window, q.device), float("-inf"))

    # The softmax runs in float32 at least (as torch.softmax does for float16
    # and bfloat16 inputs) and P is rounded to v's dtype for the PV product.
    # Subtracting the row max, not the LSE, keeps the normalisation exact when
    # scores are huge (a mask of finfo.min). Rows whose keys are all masked
    # give out = 0 and lse = -inf; their scores are zeroed first so that
    # neither the forward nor autograd through it produces NaN.
    s = s.to(torch.promote_types(s.dtype, torch.float32))
    if sinks is not None:  # one more key per row, of score sinks[h] and no value
        sink_column = sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        s = torch.cat([s, sink_column], dim=-1)
    if s.shape[-1] == 0:  # no keys at all: every row is fully masked
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), s.new_full(s.shape[:-1], float("-inf"))
    visible = (s != float("-inf")).any(dim=-1, keepdim=True)
    s = torch.where(visible, s, 0.0)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    p = torch.where(visible, p / l, 0.0)
    lse = torch.where(visible, m + torch.log(l), float("-inf")).squeeze(-1)
    if sinks is not None:
        p = p[..., :-1]
    return torch.matmul(p.to(v.dtype), v), lse


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Naive attention, same arguments and semantics as :func:`fusedattn.attention`."""
    return attention_with_lse(q, k, v, attn_mask, is_causal, scale, window, softcap, sinks)[0]
