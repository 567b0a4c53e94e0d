"""Hugging Face transformers integration.

    import fusedattn.hf
    fusedattn.hf.register()
    model = AutoModel.from_pretrained(path, attn_implementation="fusedattn")

runs every model that goes through transformers' ``AttentionInterface`` on
fusedattn. Masks are built as for ``"sdpa"`` (bool, True = may attend, or
None with a causal flag). Soft-capping (Gemma 2's ``softcap``) and attention
sinks (gpt-oss's ``s_aux``) run in the kernels. Calls the fused kernels cannot
serve (attention dropout while training, position biases, a query batch
broadcast against the keys', a dtype or head dims the device's kernels do
not take, such as head dims above 256 on CUDA, or above 128 with gradients
off Hopper) go to transformers' own SDPA function; a call with sinks or soft-capping
that fusedattn cannot serve raises, since SDPA would drop them.

Packed sequences (several documents in one row, as
``DataCollatorWithFlattening`` gives them): a call whose kwargs carry
FlashAttention's ``cu_seq_lens_q`` and ``cu_seq_lens_k`` (and
``max_length_q``/``max_length_k``) runs ``attention_varlen`` on them,
unpadded, each document causal (and windowed) on its own; the mask
transformers built for the row is not read. Without them, a row whose
``position_ids`` restart (transformers' rule: a position that is not the
previous one plus 1 starts a document) and whose mask is exactly the
block-diagonal (causal) mask they imply runs the same way, after one
comparison of that mask (a host sync, once a forward: every layer gets the
same mask, and the answer is kept while it and the position_ids are the same
tensors, unchanged; transformers builds that mask without a cache, as in
training); any other mask is read as it is.
"""

from __future__ import annotations

import functools

import weakref

import torch

from .ops import attention, attention_varlen, needs_gradients, supports

__all__ = ["attention_forward", "register"]


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention-function signature: query ``[B, Hq, L, d]``, key and
    value ``[B, Hkv, S, d]`` (grouped-query heads are native to fusedattn);
    returns ``([B, L, Hq, d], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    grads = needs_gradients(query, key, value, sinks)
    dropped = [name for name, x in (("attention sinks (s_aux)", sinks), ("soft-capping", softcap)) if x is not None]
    served = functools.partial(supports, query.device, query.dtype, query.shape[-1], value.shape[-1],
                               softcap=softcap is not None, sinks=sinks is not None, backward=grads)
    # What no fused kernel takes goes to SDPA, unless SDPA would drop the
    # soft-cap or the sinks: the gemm family serves those.
    if (dropout > 0.0 or kwargs.get("position_bias") is not None or query.shape[0] != key.shape[0]
            or not (served(fused=True) or (dropped and served()))):
        if dropped:
            raise NotImplementedError(
                f"fusedattn.hf: this call has {' and '.join(dropped)}, which transformers' SDPA would drop, "
                f"and fusedattn cannot serve it (dropout {dropout}, query batch {query.shape[0]} against "
                f"{key.shape[0]}, {query.dtype} on {query.device.type}, head dim {query.shape[-1]}, gradients "
                f"{'needed' if grads else 'not needed'}); use attn_implementation='eager'")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)

    if kwargs.get("cu_seq_lens_q") is None or kwargs.get("cu_seq_lens_k") is None:
        cu = _documents_of_the_mask(module, query, key, attention_mask, is_causal, kwargs.get("position_ids"),
                                    kwargs.get("sliding_window"))
        if cu is not None:
            kwargs = {**kwargs, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
        return _packed_forward(module, query, key, value, scaling, is_causal, softcap, sinks, kwargs), None

    # transformers' causal rule, as for SDPA: only for several queries and no
    # explicit mask, aligned top-left. Keys past the queries then are empty
    # static-cache slots; dropping them makes fusedattn's bottom-right rule the same.
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
    if is_causal and key.shape[2] > q_length:
        key, value = key[:, :, :q_length], value[:, :, :q_length]

    out = attention(query, key, value, attn_mask=attention_mask, is_causal=is_causal, scale=scaling,
                    softcap=softcap, sinks=None if sinks is None else sinks.float())
    return out.transpose(1, 2).contiguous(), None


# _documents_of_the_mask's last answer: (the mask, the position_ids (weak references), their versions,
# causal, the window and the device, cu_seqlens or None).
_last_documents: tuple | None = None


def _documents_of_the_mask(module, query, key, attention_mask, is_causal, position_ids, sliding_window=None):
    """cu_seqlens (int32) of the documents packed into one row, from where its position_ids restart,
    when the call's bool mask is exactly the block-diagonal mask they imply (causal for a causal
    module, within sliding_window of the query for a sliding layer), so that attention_varlen with
    _packed_forward's window computes the same; else None."""
    global _last_documents
    n = query.shape[2]
    if (position_ids is None or attention_mask is None or attention_mask.dtype != torch.bool
            or query.shape[0] != 1 or key.shape[2] != n or n < 2 or tuple(position_ids.shape) != (1, n)
            or attention_mask.numel() != n * n):
        return None
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    # Inference tensors keep no version, and a traced call must not hold on to tensors.
    keep = not (torch.compiler.is_compiling() or attention_mask.is_inference() or position_ids.is_inference())
    if keep:
        state = (attention_mask._version, position_ids._version, causal, sliding_window, query.device)
        if _last_documents is not None:
            mask, positions, last_state, cu = _last_documents
            if mask() is attention_mask and positions() is position_ids and last_state == state:
                return cu
    document = torch.cat([position_ids.new_zeros(1), (position_ids[0].diff() != 1).cumsum(0)])
    cu = None
    if int(document[-1]) > 0:  # else one document: the dense path
        expected = document[:, None] == document[None, :]
        if causal:
            expected &= torch.ones(n, n, dtype=torch.bool, device=expected.device).tril()
        if sliding_window is not None:  # as _packed_forward's window: keys less than sliding_window away
            steps = torch.arange(n, device=expected.device)
            expected &= (steps[:, None] - steps[None, :]).abs() < sliding_window
        if torch.equal(attention_mask.reshape(n, n), expected.to(attention_mask.device)):
            lengths = torch.bincount(document)
            cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(device=query.device, dtype=torch.int32)
    if keep:
        _last_documents = (weakref.ref(attention_mask), weakref.ref(position_ids), state, cu)
    return cu


def _packed_forward(module, query, key, value, scaling, is_causal, softcap, sinks, kwargs):
    """One row of packed documents through attention_varlen: [1, H, total, d] in, [1, total, Hq, d_v] out."""
    if query.shape[0] != 1 or key.shape[0] != 1:
        raise ValueError(f"fusedattn.hf: cu_seq_lens_q/cu_seq_lens_k describe documents packed into one row, got "
                         f"query batch {query.shape[0]} and key batch {key.shape[0]}")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # transformers' sliding_window: keys less than sliding_window positions away (before the query, if causal).
    sliding_window = kwargs.get("sliding_window")
    window = None if sliding_window is None else (sliding_window - 1, 0 if is_causal else sliding_window - 1)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = attention_varlen(q, k, v, kwargs["cu_seq_lens_q"].int(), kwargs["cu_seq_lens_k"].int(),
                           kwargs.get("max_length_q"), kwargs.get("max_length_k"), is_causal=bool(is_causal),
                           scale=scaling, window=window,
                           softcap=softcap, sinks=None if sinks is None else sinks.float())
    return out.unsqueeze(0)


def register(name: str = "fusedattn") -> None:
    """Registers fusedattn with transformers as ``attn_implementation=name``."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
