"""Modules built on the fused operator.

:class:`MultiheadAttention` is a drop-in for :class:`torch.nn.MultiheadAttention`
(same constructor, parameter names, state dict, forward signature and return
values); :func:`swap_attention` turns every ``nn.MultiheadAttention`` of a model
into it, in place.

Packed batches (documents of different lengths without padding) do not fit
``nn.MultiheadAttention``'s ``[B, N, E]`` interface: project q, k and v
yourself, keep them ``[total, H, d]`` and call :func:`fusedattn.attention_varlen`
with the documents' ``cu_seqlens`` (int32 offsets, as FlashAttention's
``flash_attn_varlen_func``), then apply the output projection to its
``[total, H, d]`` result flattened to ``[total, H x d]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops import attention, needs_gradients, supports

__all__ = ["MultiheadAttention", "swap_attention"]


def _as_keep_or_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """nn.MultiheadAttention's convention (bool True = ignore) to fusedattn's
    (bool True = may attend); floating masks are additive in both."""
    return ~mask if mask.dtype == torch.bool else mask.to(dtype)


def _as_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A keep-mask (True = may attend) as an additive one; additive masks as they are."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _combine(a: Tensor | None, b: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Both masks at once (they broadcast together)."""
    if a is None or b is None:
        return a if b is None else b
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    return _as_bias(a, dtype) + _as_bias(b, dtype)


class MultiheadAttention(torch.nn.MultiheadAttention):
    """:class:`torch.nn.MultiheadAttention` on fusedattn's fused kernels.

    Same constructor, parameters, state dict (either loads into the other),
    forward signature and return values. The fused operator serves a call when
    ``need_weights=False``, no attention dropout is active (eval mode or
    ``dropout=0``), ``add_bias_kv`` and ``add_zero_attn`` are off, and the
    device's kernels take the dtype and head dim (any on the CPU; float16 or
    bfloat16 with head dims up to 256 on CUDA; with gradients, up to 128 off
    Hopper). Every
    other call takes PyTorch's own path, which
    materialises the attention weights (memory O(N^2)) and is what
    ``need_weights=True``, the default of ``nn.MultiheadAttention``, requires:
    pass ``need_weights=False`` to get the fused kernel.

    One difference: a query whose keys are all masked gives zeros here, where
    PyTorch's path gives NaN.
    """

    def _fused_path_serves(self, query, key, value, masks, need_weights: bool) -> bool:
        dropout_active = self.training and self.dropout > 0.0
        if need_weights or dropout_active or self.bias_k is not None or self.add_zero_attn:
            return False
        masks = [m for m in masks if m is not None]
        # PyTorch's path raises for other mask dtypes, and it alone lets
        # gradients flow into a mask.
        if any(m.dtype != torch.bool and not m.is_floating_point() or m.requires_grad for m in masks):
            return False
        # The parameters are walked only where autograd is on (the walk costs a tiny call's time).
        backward = torch.is_grad_enabled() and needs_gradients(query, key, value, *self.parameters())
        return supports(query.device, query.dtype, self.head_dim, backward=backward, fused=True)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        if not self._fused_path_serves(query, key, value, (key_padding_mask, attn_mask), need_weights):
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal)
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint (as torch.nn.MultiheadAttention)")

        self_attention = query is key and key is value  # before the layout changes make three tensors
        batched = query.dim() == 3
        if not batched:  # (L, E) -> (1, L, E) in batch-first layout
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, N, E) -> (N, L, E)
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))

        n, l, _ = query.shape
        s = key.shape[1]
        h, d = self.num_heads, self.head_dim
        if self._qkv_same_embed_dim and self_attention:
            # Self-attention: one projection into q, k and v side by side (strided views).
            q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).view(n, l, 3, h, d).unbind(2)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            if self._qkv_same_embed_dim:
                w_q, w_k, w_v = self.in_proj_weight.chunk(3)
            else:
                w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
            b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
            q = F.linear(query, w_q, b_q).view(n, l, h, d).transpose(1, 2)
            k = F.linear(key, w_k, b_k).view(n, s, h, d).transpose(1, 2)
            v = F.linear(value, w_v, b_v).view(n, s, h, d).transpose(1, 2)

        # With the causal hint, no padding mask and no weights, PyTorch ignores
        # attn_mask and applies SDPA's top-left causal rule; do the same.
        causal = is_causal and key_padding_mask is None
        mask = None
        if causal and l != s:
            mask = torch.ones(l, s, dtype=torch.bool, device=q.device).tril()
            causal = False
        elif not causal:
            if attn_mask is not None:
                mask = _as_keep_or_bias(attn_mask, q.dtype)
                if mask.dim() == 3:  # (N * H, L, S) or, unbatched, (H, L, S)
                    mask = mask.view(n, h, l, s)
            if key_padding_mask is not None:
                pad = _as_keep_or_bias(key_padding_mask, q.dtype).view(n, 1, 1, s)
                mask = _combine(mask, pad, q.dtype)

        out = attention(q, k, v, attn_mask=mask, is_causal=causal)
        out = self.out_proj(out.transpose(1, 2).reshape(n, l, h * d))
        if not batched:
            return out.squeeze(0), None
        return (out if self.batch_first else out.transpose(0, 1)), None


def swap_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Makes every ``torch.nn.MultiheadAttention`` inside ``model`` a
    :class:`fusedattn.nn.MultiheadAttention`, in place (the weights, device and
    dtype are the module's own, untouched), and returns ``model``.

    ``nn.TransformerEncoderLayer`` in inference (eval mode, no autograd) may
    take PyTorch's fused native encoder path, which never calls its attention
    module's ``forward``: such layers keep PyTorch's own kernel."""
    for module in model.modules():
        if type(module) is torch.nn.MultiheadAttention:
            module.__class__ = MultiheadAttention
    return model
