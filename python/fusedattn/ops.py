"""Python side of the fusedattn operators: fake (meta) functions for tracing,
autograd for ``fusedattn::forward``, and the differentiable entry point
:func:`attention`.

The schemas and the device kernels live in C++ (``cpp/ops``); this module only
adds what torch.library expects from Python.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import Tensor

from . import backends
from ._compile import assume_constant_result
from .blockmask import BlockMask
from .distributed.routing import routed_attention

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "cuda_head_dims", "has_kernel", "plan",
           "needs_gradients", "plan_kvcache", "plan_varlen", "supports"]

# What the fused CUDA kernels take (the gemm family takes float32 too); the
# CPU kernels take float32, float16 and bfloat16 at any head dim.
CUDA_DTYPES = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def has_kernel(op: str, device_type: str) -> bool:
    """Whether ``fusedattn::<op>`` has a kernel for ``device_type`` ("cpu", "cuda") in this build."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"fusedattn::{op}", device_type.upper())


@functools.cache
def cuda_head_dims(kernel: str | None = None) -> tuple[int, ...]:
    """The head dims a CUDA kernel of this build is instantiated for (the table
    in ``cpp/generate_kernels.py``); () in a build without CUDA kernels. None:
    those of sm80's forward and backward, every CUDA call's fallback, so the
    head dims CUDA's forward and backward serve natively. Other head dims (and
    a v head dim of its own) run zero-padded to the next of the forward's
    ("sm80_forward") or the backward's ("sm80_backward", and on Hopper
    "sm90_backward"), up to their largest."""
    if not has_kernel("forward", "cuda"):
        return ()
    if kernel is None:
        backward = cuda_head_dims("sm80_backward")
        return tuple(d for d in cuda_head_dims("sm80_forward") if d in backward)
    return tuple(torch.ops.fusedattn.instantiated_head_dims(kernel))


def needs_gradients(*tensors: Tensor | None) -> bool:
    """Whether autograd will run the backward of a call on these tensors (None: absent)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def supports(device: torch.device, dtype: torch.dtype, head_dim: int, value_head_dim: int | None = None, *,
             softcap: bool = False, sinks: bool = False, backward: bool = True, fused: bool = False) -> bool:
    """Whether fusedattn serves attention on this device, dtype and head dim
    (and v's head dim, None: the same): the forward, and with ``backward`` the
    backward too. ``softcap`` and ``sinks`` say whether the call soft-caps or
    has sinks; every path serves both. On CUDA the gemm family (float32
    matrix products, a block of query rows at a time) serves what the fused
    kernels do not; with ``fused`` only a fused kernel counts: the planner's
    answer for a call of these head dims and options on this device (under
    ``torch.use_deterministic_algorithms`` too), without attn_mask (which
    this function is not told of); with no CUDA device, the head dims every
    CUDA device's kernels serve."""
    if dtype not in DTYPES or device.type not in ("cpu", "cuda"):
        return False
    if device.type == "cpu":
        return True
    if not has_kernel("forward", "cuda"):
        return False
    if not fused:
        return True
    return dtype in CUDA_DTYPES and _planned_fused(device, dtype, head_dim, value_head_dim or head_dim, softcap,
                                                   sinks, backward, torch.are_deterministic_algorithms_enabled())


@assume_constant_result
def _planned_fused(device: torch.device, dtype: torch.dtype, head_dim: int, value_head_dim: int, softcap: bool,
                   sinks: bool, backward: bool, deterministic: bool) -> bool:
    """supports(fused=True) on CUDA, asked of the planner once per argument set
    (constant to torch.compile: a plan depends on these alone)."""
    return _planned_fused_cached(device, dtype, head_dim, value_head_dim, softcap, sinks, backward, deterministic)


@functools.cache
def _planned_fused_cached(device, dtype, head_dim, value_head_dim, softcap, sinks, backward, deterministic) -> bool:
    del deterministic  # a key of the cache; the planner reads the global setting itself
    if not torch.cuda.is_available():
        served = torch.ops.fusedattn.served_head_dims(backward)
        return max(head_dim, value_head_dim) <= served[-1]
    q, k = (torch.empty(1, 1, 1, head_dim, device=device, dtype=dtype) for _ in range(2))
    v = torch.empty(1, 1, 1, value_head_dim, device=device, dtype=dtype)
    sink = torch.zeros(1, device=device) if sinks else None
    try:
        plan = _parse_plan(torch.ops.fusedattn.plan(q, k, v, None, False, None, None, backward, None,
                                                    1.0 if softcap else None, sink))
    except RuntimeError:  # a call no path takes (a head dim below 1, say)
        return False
    return plan["family"] != "gemm"


def _on_q_device(op: str, q: Tensor, **tensors: Tensor | None) -> None:
    """A fake function also runs, instead of the kernel, when one argument is on meta and the
    others are not (the dispatcher then picks Meta), so it checks what the kernels' checks would
    first: every tensor on q's device (else the call would return uninitialised memory)."""
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise RuntimeError(f"fusedattn::{op}: {name} must be on the device of q ({q.device}), got {t.device}")


def _grad_sinks_fake(q, sinks):
    """The backwards' grad_sinks: float32 [Hq] (q's dimension 1, dense and packed), or empty without sinks."""
    return q.new_empty((q.shape[1],) if sinks is not None else (0,), dtype=torch.float32)


@torch.library.register_fake("fusedattn::forward")
def _forward_fake(q, k, v, attn_mask=None, is_causal=False, scale=None, family=None, window=None, softcap=None,
                  sinks=None):
    _on_q_device("forward", q, k=k, v=v, attn_mask=attn_mask, sinks=sinks)
    out = q.new_empty((*q.shape[:3], v.shape[3]))
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    return out, lse


@torch.library.register_fake("fusedattn::backward")
def _backward_fake(grad_out, q, k, v, out, lse, attn_mask=None, is_causal=False, scale=None, family=None,
                   window=None, softcap=None, sinks=None):
    _on_q_device("backward", q, grad_out=grad_out, k=k, v=v, out=out, lse=lse, attn_mask=attn_mask, sinks=sinks)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _grad_sinks_fake(q, sinks)


@torch.library.register_fake("fusedattn::forward_kvcache")
def _forward_kvcache_fake(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, is_causal=True,
                          scale=None, num_splits=None, merge_in_cluster=None, warps=None, window=None,
                          softcap=None, sinks=None, cu_seqlens_q=None, block_table=None):
    _on_q_device("forward_kvcache", q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k_new=k_new,
                 v_new=v_new, sinks=sinks, cu_seqlens_q=cu_seqlens_q, block_table=block_table)
    if cu_seqlens_q is not None:  # packed: out [total_q, Hq, d_v], lse [Hq, total_q]
        return q.new_empty((*q.shape[:2], v_cache.shape[3])), q.new_empty((q.shape[1], q.shape[0]),
                                                                          dtype=torch.float32)
    return q.new_empty((*q.shape[:3], v_cache.shape[3])), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.register_fake("fusedattn::forward_varlen")
def _forward_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=False,
                         scale=None, family=None, window=None, softcap=None, sinks=None):
    _on_q_device("forward_varlen", q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sinks=sinks)
    return q.new_empty((*q.shape[:2], v.shape[2])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.register_fake("fusedattn::backward_varlen")
def _backward_varlen_fake(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          is_causal=False, scale=None, family=None, window=None, softcap=None, sinks=None):
    _on_q_device("backward_varlen", q, grad_out=grad_out, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q,
                 cu_seqlens_k=cu_seqlens_k, sinks=sinks)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _grad_sinks_fake(q, sinks)


@torch.library.register_fake("fusedattn::naive_forward")
def _naive_forward_fake(q, k, v, attn_mask=None, is_causal=False, scale=None):
    _on_q_device("naive_forward", q, k=k, v=v, attn_mask=attn_mask)
    return q.new_empty((*q.shape[:3], v.shape[3]))


# fusedattn::forward's autograd is C++ (cpp/ops/autograd.cpp): a Python one costs
# a grad-enabled call about 35 us of host time.


def _setup_varlen_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, family, window, softcap,
     sinks) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.is_causal, ctx.scale, ctx.family, ctx.window, ctx.softcap = is_causal, scale, family, window, softcap
    ctx.mark_non_differentiable(lse)


def _backward_varlen(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks = ctx.saved_tensors
    if grad_out is None:
        return (None,) * 13
    grad_q, grad_k, grad_v, grad_sinks = torch.ops.fusedattn.backward_varlen(
        grad_out.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens, ctx.is_causal,
        ctx.scale, ctx.family, ctx.window, ctx.softcap, sinks
    )
    return (grad_q, grad_k, grad_v) + (None,) * 9 + (grad_sinks if sinks is not None else None,)


torch.library.register_autograd("fusedattn::forward_varlen", _backward_varlen, setup_context=_setup_varlen_context)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | BlockMask | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Exact scaled dot-product attention, fused (the N x N scores never reach memory;
    on CUDA, what no fused kernel takes runs on the gemm family, whose memory grows
    with a block of query rows: see :func:`plan`).

    Args:
        q: ``[B, Hq, Nq, d]`` queries.
        k, v: ``[B, Hkv, Nk, d]`` keys and ``[B, Hkv, Nk, d_v]`` values;
            ``Hq % Hkv == 0`` (query head ``h`` reads key/value head
            ``h // (Hq // Hkv)``). ``d_v`` may differ from ``d`` (on CUDA's fused kernels both
            run zero-padded to the next head dim its kernels are built for).
        attn_mask: broadcastable to ``[B, Hq, Nq, Nk]``; bool (True = may attend)
            or floating point (added to the scaled scores); or a
            :class:`fusedattn.BlockMask`. Tiles a mask hides are skipped, tiles
            it leaves whole (all True, or all 0) read none of it.
        is_causal: hide key ``j`` from query ``i`` when ``j > i + (Nk - Nq)``
            (bottom-right alignment; equal to SDPA's rule when ``Nq == Nk``).
        scale: multiplies ``q @ k^T``; defaults to ``1 / sqrt(d)``.
        window: ``(left, right)``, a sliding window aligned as ``is_causal``: query ``i``
            sees key ``j`` only when ``i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right``;
            -1 leaves that side unbounded (FlashAttention's ``window_size``).
            ``is_causal=True`` is the window ``(-1, 0)``; window, ``is_causal`` and
            ``attn_mask`` combine.
        softcap: ``None`` or a number > 0: the scaled scores become
            ``softcap * tanh(scores / softcap)`` before ``attn_mask`` is added
            (Gemma 2's soft-capping).
        sinks: ``None`` or float32 ``[Hq]``: one logit per query head that joins
            every row's softmax normaliser and carries no value (gpt-oss's
            attention sinks); differentiable. A row that sees no key then
            gives 0, the sink taking all the mass.

    Inside ``fusedattn.distributed.context_parallel`` the call runs on the ring:
    q, k and v are this rank's shards of the sequence.

    Returns:
        ``[B, Hq, Nq, d_v]`` in q's dtype. Rows whose keys are all masked are 0.
        Differentiable with respect to q, k and v.
    """
    if isinstance(attn_mask, BlockMask):
        attn_mask = attn_mask.for_call(q, k)
    window = _window(window, "attention")
    routed = routed_attention(q, k, v, attn_mask, is_causal, scale, window, softcap, sinks)
    if routed is not None:
        return routed
    out, _ = torch.ops.fusedattn.forward(q, k, v, attn_mask, is_causal, scale, backends.forced().family, window,
                                         softcap, sinks)
    return out


def _window(window, api: str) -> tuple[int, int] | None:
    """window as the operators take it: None or two ints, each >= -1, from any sequence of two
    integers (a tuple, a list, a numpy array, SymInts under torch.compile). The operators check
    the values; a float, a lone number or an int past int64 their schema refuses without
    naming it, and a bool it takes as 0 or 1: each is refused here, with the value given."""
    if window is None:
        return None
    try:
        sides = list(window)
    except TypeError:
        sides = []
    try:
        if len(sides) != 2 or any(isinstance(side, bool) for side in sides):
            raise TypeError
        sides = [side if isinstance(side, torch.SymInt) else operator.index(side) for side in sides]
        if any(isinstance(side, int) and not -1 <= side < 2**63 for side in sides):
            raise TypeError
    except TypeError:
        raise RuntimeError(f"fusedattn.{api}: window must be two ints [left, right], each >= -1 (-1: no bound on "
                           f"that side), got {window!r}") from None
    return tuple(sides)


def _max_seqlen(max_seqlen: int | None, cu_seqlens: Tensor, name: str, api: str) -> int:
    """max_seqlen as given, or the longest sequence cu_seqlens describes (0 for none), read on
    the host; under torch.compile that read would break the graph, so it must be given."""
    if max_seqlen is not None:
        return max_seqlen
    if torch.compiler.is_compiling():
        raise RuntimeError(f"fusedattn.{api}: under torch.compile pass max_seqlen_{name} as a Python int (without "
                           f"it the call reads cu_seqlens_{name} on the host)")
    if cu_seqlens.dim() != 1:
        raise RuntimeError(f"fusedattn.{api}: cu_seqlens_{name} must be int32 [B + 1], got shape "
                           f"{list(cu_seqlens.shape)}")
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention over a batch of sequences of different lengths, packed without padding.

    Args:
        q: ``[total_q, Hq, d]``, the sequences' queries one after another.
        k, v: ``[total_k, Hkv, d]`` and ``[total_k, Hkv, d_v]``; ``Hq % Hkv == 0``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]`` on the tensors' device, from 0,
            non-decreasing, to the total: sequence ``b`` is rows
            ``cu_seqlens[b] : cu_seqlens[b + 1]`` and attends to its own keys only.
            A sequence may be empty on either side.
        max_seqlen_q, max_seqlen_k: bounds on the sequences' lengths, as Python ints
            (so that ``torch.compile`` traces the call without reading the tensors);
            None computes them from ``cu_seqlens``, which waits for the device.
        is_causal: bottom-right aligned per sequence, as :func:`attention`'s.
        scale: multiplies ``q @ k^T``; defaults to ``1 / sqrt(d)``.
        window: ``(left, right)``, :func:`attention`'s sliding window, aligned per
            sequence as ``is_causal``: query ``i`` of sequence ``b`` sees its key ``j``
            only when ``i + Nk_b - Nq_b - left <= j <= i + Nk_b - Nq_b + right``.
        softcap, sinks: as :func:`attention`'s.

    Returns:
        ``[total_q, Hq, d_v]`` in q's dtype; rows that see no key are 0.
        Differentiable with respect to q, k, v (and sinks).

    On CUDA the call reads ``cu_seqlens`` on the host to check them and to
    order the work (longest first), so it waits for the device once;
    :func:`plan_varlen` shows the plan. As FlashAttention 3's, the sm90
    kernels' last tile of a sequence reads the next sequence's rows and
    multiplies them by 0: an Inf or NaN in one sequence's v (or, in the
    backward, q, k and grad_out) can make a neighbour's results NaN.
    """
    if not torch.compiler.is_compiling() and not has_kernel("forward_varlen", q.device.type):
        raise NotImplementedError(f"fusedattn.attention_varlen: this build has no {q.device.type} kernel for packed "
                                  f"sequences")
    max_seqlen_q = _max_seqlen(max_seqlen_q, cu_seqlens_q, "q", "attention_varlen")
    max_seqlen_k = _max_seqlen(max_seqlen_k, cu_seqlens_k, "k", "attention_varlen")
    window = _window(window, "attention_varlen")
    out, _ = torch.ops.fusedattn.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                is_causal, scale, backends.forced().family, window, softcap, sinks)
    return out


def attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    k_new: Tensor | None = None,
    v_new: Tensor | None = None,
    is_causal: bool = True,
    scale: float | None = None,
    num_splits: int | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None,
    block_table: Tensor | None = None,
) -> Tensor:
    """Attention of a few new queries per sequence against a preallocated KV cache.

    Args:
        q: ``[B, Hq, Nq, d]``, usually Nq = 1 (decoding) or a short chunk.
        k_cache, v_cache: ``[B, Hkv, max_len, d]`` and ``[B, Hkv, max_len, d_v]``
            (``d_v == d`` on CUDA), modified in place when ``k_new`` and ``v_new``
            are given.
        cache_seqlens: int32 ``[B]``, the number of valid cached positions of
            each sequence before this call. It is not updated: add ``Nnew``
            yourself once the call returns.
        k_new, v_new: ``[B, Hkv, Nnew, d]`` and ``[B, Hkv, Nnew, d_v]``, or None; written into the caches at
            positions ``cache_seqlens[b] .. cache_seqlens[b] + Nnew - 1``.
        is_causal: bottom-right aligned per sequence: query i of sequence b sees
            cache position j when ``j <= i + L_b - Nq`` with
            ``L_b = cache_seqlens[b] + Nnew``.
        num_splits: on CUDA, how many thread blocks split each sequence's keys
            (1 to 64, at most one per 64 cached positions); None lets the
            planner choose (``plan_kvcache`` shows its choice). The CPU ignores it.
        window: ``(left, right)`` as :func:`attention`'s, per sequence against its
            ``L_b`` positions (so ``(W - 1, 0)`` lets a query see its last W positions).
        softcap, sinks: as :func:`attention`'s.
        cu_seqlens_q: int32 ``[B + 1]``: queries of many lengths in one call (chunked
            prefill beside decoding), packed as :func:`attention_varlen`'s: q
            ``[total_q, Hq, d]``, sequence b's queries its rows ``cu_seqlens_q[b] :
            cu_seqlens_q[b + 1]``, and k_new, v_new ``[total_q, Hkv, d]`` and
            ``[total_q, Hkv, d_v]`` (or None) its new keys, so ``L_b =
            cache_seqlens[b] + Nq_b`` (without them ``cache_seqlens[b]``). The lengths are read on the host (a sync: no CUDA graph);
            on CUDA the varlen forward serves it, with num_splits None.
        block_table: int32 ``[B, max_blocks]``, or None: a paged cache (on CUDA pages of a multiple of 16).
            k_cache and v_cache are then ``[pages, Hkv, page_size, d]`` and ``[pages, Hkv,
            page_size, d_v]``, shared by the sequences: position p of sequence b is row
            ``p % page_size`` of page ``block_table[b, p // page_size]``, so a sequence holds
            ``max_blocks * page_size`` positions. Sequences may read the same pages (a shared
            prefix), but a page a sequence appends into is that sequence's alone in the call.
            Without cu_seqlens_q, CUDA does not read the table on the host: an entry outside
            ``[0, pages)`` that the attention reads gives its sequence NaN, and no new key is
            written through one (the CPU raises for any entry below the sequence's length).

    Returns:
        ``[B, Hq, Nq, d_v]`` (with cu_seqlens_q ``[total_q, Hq, d_v]``). Not
        differentiable (an inference operator).
    """
    forced = backends.forced()
    window = _window(window, "attention_with_kvcache")
    out, _ = torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, is_causal, scale,
                                                 num_splits, forced.decode_merge_in_cluster, forced.decode_warps,
                                                 window, softcap, sinks, cu_seqlens_q, block_table)
    return out


def _parse_plan(words: str) -> dict:
    def value(text: str):
        if text in ("true", "false"):
            return text == "true"
        return int(text) if text.lstrip("-").isdigit() else text

    return {key: value(v) for key, v in (word.split("=", 1) for word in words.split())}


def plan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | BlockMask | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    backward: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> dict:
    """The plan :func:`attention` would run for these arguments (with
    ``backward=True``, its backward's), without running it: a dict with
    ``"family"`` ("cpu", "sm80", "sm90", "gemm"), ``"block_m"`` and ``"block_n"``
    (queries and keys per tile), ``"warps"``, ``"mask_tiles"`` (CUDA: whether
    attn_mask is first sorted into the tiles it hides, leaves whole or cuts),
    ``"persistent"`` (sm90; with ``"resident_blocks"``, how many blocks take
    the work items), ``"head_splits"`` and ``"deterministic"`` (backward). Choices
    forced with :func:`fusedattn.backends.force` apply; the same errors as the
    call's are raised for bad arguments."""
    if isinstance(attn_mask, BlockMask):
        attn_mask = attn_mask.for_call(q, k)
    window = _window(window, "plan")
    return _parse_plan(torch.ops.fusedattn.plan(q, k, v, attn_mask, is_causal, scale, backends.forced().family,
                                                backward, window, softcap, sinks))


def plan_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    backward: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> dict:
    """The plan :func:`attention_varlen` would run for these arguments (with
    ``backward=True``, its backward's): :func:`plan`'s keys and ``"varlen":
    True``; on CUDA's fused kernels also ``"schedule"`` ("longest-first")
    and ``"work_items"``, the (sequence, tile) items of its work list (query
    tiles; the backward's: key tiles). The CPU and the gemm family run a
    sequence at a time."""
    max_seqlen_q = _max_seqlen(max_seqlen_q, cu_seqlens_q, "q", "plan_varlen")
    max_seqlen_k = _max_seqlen(max_seqlen_k, cu_seqlens_k, "k", "plan_varlen")
    window = _window(window, "plan_varlen")
    return _parse_plan(torch.ops.fusedattn.plan_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                       max_seqlen_k, is_causal, scale, backends.forced().family,
                                                       backward, window, softcap, sinks))


def plan_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor | None = None,
    k_new: Tensor | None = None,
    v_new: Tensor | None = None,
    is_causal: bool = True,
    scale: float | None = None,
    num_splits: int | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None,
    block_table: Tensor | None = None,
) -> dict:
    """The plan :func:`attention_with_kvcache` would run for these arguments:
    on CUDA ``"family": "decode"`` with ``"num_splits"``,
    ``"merge_in_cluster"``, ``"warps"``, ``"block_m"`` and ``"block_n"``. It
    depends on the caches' capacity, not on ``cache_seqlens`` or the new keys
    (accepted so that the call's arguments can be passed as they are). With
    ``cu_seqlens_q`` (packed queries), the varlen forward's plan
    (:func:`plan_varlen`'s keys), ordered by ``cache_seqlens`` and the new keys.
    ``block_table``: paged caches, as :func:`attention_with_kvcache` takes them.
    Where no kernel takes the call (float32, a head dim the kernels are not
    built for, v's head dim of its own), ``"family": "gemm"``: a sequence at a
    time, the lengths read on the host."""
    forced = backends.forced()
    window = _window(window, "plan_kvcache")
    seqused_k = None
    if cu_seqlens_q is not None:
        if cache_seqlens is None:
            raise ValueError("fusedattn.plan_kvcache: packed queries (cu_seqlens_q) need cache_seqlens")
        seqused_k = cache_seqlens if k_new is None else (cache_seqlens + cu_seqlens_q.diff()).int()
    return _parse_plan(torch.ops.fusedattn.plan_kvcache(q, k_cache, v_cache, is_causal, scale, num_splits,
                                                        forced.decode_merge_in_cluster, forced.decode_warps, window,
                                                        softcap, sinks, cu_seqlens_q, seqused_k, block_table))
