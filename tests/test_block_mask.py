"""fusedattn.BlockMask and fusedattn.block_mask: built from a mask_mod (per batch,
per head, shared) and from dense masks, passed as attn_mask on every backend,
forward and backward, against the float64 reference with the dense mask; bad
input; torch.compile with dynamic lengths."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fusedattn
from fusedattn import reference
from helpers.attention_cases import FLOOR, Case, assert_within_rule


def documents(lengths, nq=None):
    """mask_mod of causal documents of these lengths packed into the keys; nq queries are
    the last nq positions (bottom-right aligned), all of them by default."""
    offset = 0 if nq is None else sum(lengths) - nq

    def mask_mod(b, h, q_idx, kv_idx):
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=q_idx.device),
                                      torch.tensor(lengths, device=q_idx.device))
        position = q_idx + offset
        return (position >= 0) & (doc[position.clamp(min=0)] == doc[kv_idx]) & (kv_idx <= position)
    return mask_mod


def key_lengths(lengths):
    """mask_mod of per-batch key lengths (padding)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < torch.tensor(lengths, device=kv_idx.device)[b]
    return mask_mod


def head_windows(b, h, q_idx, kv_idx):
    """Head h sees the last 40 (h + 1) keys before the query: a different mask per head."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 40 * (h + 1))


def dense_of(mask_mod, B, H, Nq, Nk):
    """The mask by brute force, entry by entry over the broadcast index grid."""
    b, h, i, j = torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(Nq), torch.arange(Nk), indexing="ij")
    return mask_mod(b, h, i, j)


def check_block_mask_call(backend, bm, B, Hq, Hkv, Nq, Nk, d=64, backward=False, **kwargs):
    dtype = backend.primary_dtype
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, n, d, generator=g) for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))
    q, k, v = (t.to(backend.device, dtype).requires_grad_(backward) for t in (q, k, v))
    bm = fusedattn.BlockMask(bm.mask.to(backend.device))
    dense = bm.to_dense()
    plan = fusedattn.plan(q, k, v, bm, backward=backward, **kwargs)
    assert plan["family"] == backend.name, plan
    out = fusedattn.attention(q, k, v, attn_mask=bm, **kwargs)
    args = (dense, kwargs.get("is_causal", False), None, kwargs.get("window"))
    q64, k64, v64 = (t.detach().double().requires_grad_(backward) for t in (q, k, v))
    oracle = reference.attention(q64, k64, v64, *args)
    low = reference.attention(q.detach(), k.detach(), v.detach(), *args)
    assert_within_rule("out", out, oracle, low, dtype, factor=2)
    if backward:
        grad = torch.randn_like(oracle)
        out.backward(grad.to(out.dtype))
        oracle.backward(grad)
        for name, t, t64 in (("dq", q, q64), ("dk", k, k64), ("dv", v, v64)):
            err = (t.grad.double() - t64.grad).abs().max().item()
            assert err <= 40 * FLOOR[dtype] * (1 + t64.grad.abs().max().item()), f"{name}: error {err}"


def test_block_mask_from_mask_mod_matches_brute_force():
    """Held in the shape mask_mod's result broadcasts to: key lengths as one row per batch item,
    a mask that ignores b once for every batch item."""
    for mod, B, H, held in ((documents([5, 17, 1, 40]), None, None, (1, 1, 63, 63)),
                            (key_lengths([63, 5, 0]), 3, None, (3, 1, 1, 63)),
                            (head_windows, None, 3, (1, 3, 63, 63)), (head_windows, 2, 3, (1, 3, 63, 63))):
        bm = fusedattn.block_mask(mod, B, H, 63, 63)
        assert bm.mask.shape == held
        assert torch.equal(bm.to_dense().expand(B or 1, H or 1, 63, 63), dense_of(mod, B or 1, H or 1, 63, 63))


def test_block_mask_evaluates_large_masks_in_row_bands(monkeypatch):
    monkeypatch.setitem(fusedattn.block_mask.__globals__, "_CHUNK_ENTRIES", 500)
    mod = documents([30, 70, 29])

    def per_batch(b, h, q_idx, kv_idx):
        return mod(b, h, q_idx, kv_idx) & (kv_idx >= b)
    bm = fusedattn.block_mask(per_batch, 2, None, 129, 129)
    assert torch.equal(bm.to_dense(), dense_of(per_batch, 2, 1, 129, 129))


@pytest.mark.parametrize("nq,nk", [(129, 129), (300, 200), (97, 700)])
def test_block_mask_attention(backend, nq, nk):
    """Documents (Nk positions), per-batch key lengths and per-head windows; lengths that are
    not multiples of any tile."""
    docs = documents([nk // 3, 1, nk - nk // 3 - 1], nq)
    check_block_mask_call(backend, fusedattn.block_mask(docs, None, None, nq, nk), 2, 4, 2, nq, nk)
    pad = key_lengths([nk, nk // 2, 1])
    check_block_mask_call(backend, fusedattn.block_mask(pad, 3, None, nq, nk), 3, 4, 2, nq, nk, is_causal=True)
    check_block_mask_call(backend, fusedattn.block_mask(head_windows, None, 4, nq, nk), 1, 4, 4, nq, nk,
                          window=(50, 0))


@pytest.mark.parametrize("mod,B,H", [(documents([100, 3, 197]), None, None), (key_lengths([300, 120]), 2, None),
                                     (head_windows, None, 4)], ids=["documents", "key_lengths", "per_head"])
def test_block_mask_backward(backend, mod, B, H):
    check_block_mask_call(backend, fusedattn.block_mask(mod, B, H, 300, 300), 2, 4, 2, 300, 300, backward=True)


def test_block_mask_from_dense():
    m = torch.rand(5, 7) > 0.5
    bm = fusedattn.BlockMask.from_dense(m)
    assert bm.mask.shape == (1, 1, 5, 7) and torch.equal(bm.to_dense()[0, 0], m)
    pad = torch.rand(3, 1, 1, 7) > 0.5
    assert fusedattn.BlockMask.from_dense(pad).mask.shape == (3, 1, 1, 7)
    assert fusedattn.BlockMask.from_dense(pad).mask.data_ptr() == pad.data_ptr()  # no copy


def test_block_mask_from_dense_key_padding_attention(backend):
    """A [B, 1, 1, Nk] padding mask stays broadcast (its rows are one row to the kernels)."""
    pad = torch.arange(400)[None, :] < torch.tensor([400, 131, 1])[:, None]
    bm = fusedattn.BlockMask.from_dense(pad.view(3, 1, 1, 400))
    check_block_mask_call(backend, bm, 3, 2, 1, 250, 400)


def test_block_mask_rows_that_see_nothing(backend):
    def mod(b, h, q_idx, kv_idx):
        return (q_idx >= 128) & (kv_idx < q_idx - 100)
    check_block_mask_call(backend, fusedattn.block_mask(mod, None, None, 300, 300), 1, 2, 1, 300, 300,
                          backward=True)


def test_block_mask_bad_input():
    with pytest.raises(TypeError, match="mask_mod must return a bool tensor, got torch.int64"):
        fusedattn.block_mask(lambda b, h, q, kv: q - kv, None, None, 8, 8)
    with pytest.raises(ValueError, match=r"mask_mod returned shape \[3, 1, 1, 1\], which does not broadcast"):
        fusedattn.block_mask(lambda b, h, q, kv: torch.ones(3, 1, 1, 1, dtype=torch.bool), 2, None, 8, 8)
    with pytest.raises(ValueError, match="B must be a positive int or None, got 0"):
        fusedattn.block_mask(head_windows, 0, None, 8, 8)
    with pytest.raises(ValueError, match="Nk must be an int >= 0, got -1"):
        fusedattn.block_mask(head_windows, None, None, 8, -1)
    with pytest.raises(TypeError, match="expected a bool tensor, got torch.float32"):
        fusedattn.BlockMask.from_dense(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"expected \[Nq, Nk\] up to \[B, H, Nq, Nk\], got shape \[4\]"):
        fusedattn.BlockMask.from_dense(torch.ones(4, dtype=torch.bool))
    q = torch.randn(2, 4, 16, 32)
    k = torch.randn(2, 2, 24, 32)
    for (B, H, nq, nk), what in (((3, None, 16, 24), "batch 3, the call has 2"), ((None, 2, 16, 24), "heads 2, the "
                                 "call has 4"), ((None, None, 17, 24), "Nq 17, the call has 16"),
                                 ((None, None, 16, 23), "Nk 23, the call has 24")):
        bm = fusedattn.block_mask(lambda b, h, qi, kv: (kv <= qi + b) & (h >= 0), B, H, nq, nk)  # reads b and h
        with pytest.raises(ValueError, match=f"the BlockMask has {what}"):
            fusedattn.attention(q, k, k, attn_mask=bm)


@given(st.lists(st.integers(1, 60), min_size=1, max_size=6), st.integers(-1, 50), st.booleans())
def test_block_mask_documents_property_cpu(lengths, left, per_batch):
    """Random packed documents (and a window), per batch or shared, against the reference."""
    n = sum(lengths)
    B = 2 if per_batch else None
    mod = documents(lengths)
    if per_batch:
        def mod(b, h, q_idx, kv_idx, inner=documents(lengths)):  # batch 1 also hides the first key
            return inner(b, h, q_idx, kv_idx) & ((b == 0) | (kv_idx > 0))
    bm = fusedattn.block_mask(mod, B, None, n, n)
    check_block_mask_call(fusedattn_cpu_backend(), bm, 2, 2, 1, n, n, d=32, window=(left, -1) if left >= 0 else None)


@settings(max_examples=20)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(-1, 30))
def test_block_mask_gradients_property_cpu(lengths, left):
    """dq, dk, dv under random packed documents (and a window) against float64 autograd."""
    n = sum(lengths)
    bm = fusedattn.block_mask(documents(lengths), None, None, n, n)
    check_block_mask_call(fusedattn_cpu_backend(), bm, 1, 2, 1, n, n, d=16, backward=True,
                          window=(left, -1) if left >= 0 else None)


def fusedattn_cpu_backend():
    from helpers.backends import Backend

    return Backend("cpu")


def test_block_mask_under_torch_compile_with_dynamic_lengths():
    """fullgraph, dynamic N: the BlockMask is a tensor to the graph; two lengths, one graph."""
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, dynamic=True)
    def f(q, k, v, bm):
        return fusedattn.attention(q, k, v, attn_mask=bm)

    for n in (40, 71):
        q, k, v = (torch.randn(2, 2, n, 32) for _ in range(3))
        bm = fusedattn.block_mask(documents([n // 2, n - n // 2]), None, None, n, n)
        torch.testing.assert_close(f(q, k, v, bm), fusedattn.attention(q, k, v, attn_mask=bm.to_dense()),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_hidden_tiles_are_never_read(backend, head_dim):
    """Keys 256.. are hidden from every query (256 is a multiple of every kernel's key tile)
    and hold NaN in K and V: a kernel that visited their tiles would spread NaN (NaN times a
    hidden entry's weight of 0 is NaN). Forward and backward equal attention over the first
    256 keys; those keys' gradients are 0."""
    dtype = backend.primary_dtype
    g = torch.Generator().manual_seed(1)
    B, H, nq, nk, visible = 2, 2, 300, 512, 256
    q, k, v = (torch.randn(B, H, n, head_dim, generator=g) for n in (nq, nk, nk))
    inside = torch.rand(nq, visible, generator=g) > 0.3  # partly visible tiles too
    inside[:, 0] = True
    mask = torch.zeros(nq, nk, dtype=torch.bool)
    mask[:, :visible] = inside
    k[:, :, visible:] = float("nan")
    v[:, :, visible:] = float("nan")
    q, k, v = (t.to(backend.device, dtype).requires_grad_() for t in (q, k, v))
    backend.require(dataclasses.replace(Case(), dtype=dtype, head_dim=head_dim), backward=True)
    bm = fusedattn.BlockMask.from_dense(mask.to(backend.device))
    assert fusedattn.plan(q, k, v, bm)["family"] == backend.name
    out = fusedattn.attention(q, k, v, attn_mask=bm)
    grad = torch.randn_like(out)
    out.backward(grad)
    q2, k2, v2 = (t.detach()[:, :, :n].clone().requires_grad_() for t, n in ((q, nq), (k, visible), (v, visible)))
    ref = fusedattn.attention(q2, k2, v2, attn_mask=inside.to(backend.device))
    ref.backward(grad)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=2 * FLOOR[dtype], rtol=0)
    torch.testing.assert_close(q.grad, q2.grad, atol=40 * FLOOR[dtype], rtol=0)
    torch.testing.assert_close(k.grad[:, :, :visible], k2.grad, atol=40 * FLOOR[dtype], rtol=0)
    assert (k.grad[:, :, visible:] == 0).all() and (v.grad[:, :, visible:] == 0).all()
