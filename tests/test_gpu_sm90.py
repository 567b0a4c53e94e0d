"""The sm90 (wgmma) forward against the float64 reference, forced with
FUSEDATTN_KERNEL_FAMILY=sm90 (marker `gpu`; skipped where the build or the
device has no sm90 kernels)."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fusedattn
from attention_cases import MASK_KINDS, Case, check_forward, make_inputs
from test_forward import cases
from test_gpu import GPU_DTYPES, check_cuda

pytestmark = pytest.mark.gpu
SM90_HEAD_DIMS = [64, 128]


@pytest.fixture(autouse=True)
def sm90(monkeypatch):
    monkeypatch.setenv("FUSEDATTN_KERNEL_FAMILY", "sm90")
    q, k, v, _ = make_inputs(Case(dtype=torch.float16, head_dim=64), "cuda")
    try:
        torch.ops.fusedattn.forward(q, k, v)
    except RuntimeError as e:
        if "has no sm90 kernels" in str(e):
            pytest.skip(str(e).splitlines()[0])
        raise


@given(cases(max_len=700), st.sampled_from(GPU_DTYPES), st.sampled_from(SM90_HEAD_DIMS))
def test_sm90_random_cases(case, dtype, head_dim):
    check_cuda(dataclasses.replace(case, dtype=dtype, head_dim=head_dim, mask="none"))


@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 1025), (7, 300), (300, 7), (97, 113), (128, 128),
                                   (129, 64), (1025, 1025), (2048, 1000)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_sm90_awkward_lengths(nq, nk, is_causal, head_dim, dtype):
    check_cuda(Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=nq, seqlen_k=nk, head_dim=head_dim,
                    dtype=dtype, is_causal=is_causal))


@pytest.mark.parametrize("nq,nk", [(1000, 1000), (2000, 700)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim,mask", [(64, "none"), (128, "none"), (128, "bool")])
def test_sm90_blocks_take_many_items(nq, nk, is_causal, head_dim, mask):
    """More query blocks than SMs (3 x 12 heads x 6-16 blocks), so at d=128, and at d=64 under
    causal, every persistent block takes several work items; under causal with Nq > Nk the first query blocks of each head
    see no key, and their zero rows sit among the others. Two calls in a row: each starts
    its own count of the items handed out."""
    case = Case(batch=3, heads_q=12, heads_kv=4, seqlen_q=nq, seqlen_k=nk, head_dim=head_dim,
                dtype=torch.bfloat16, is_causal=is_causal, mask=mask)
    check_cuda(case)
    check_cuda(case)


@pytest.mark.parametrize("n", [4096, 8192])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sm90_long_sequences(n, is_causal):
    check_cuda(Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=n, seqlen_k=n, head_dim=128,
                    dtype=torch.bfloat16, is_causal=is_causal))


@pytest.mark.parametrize("batch,heads_q,heads_kv,nq,nk", [(1, 2, 1, 1000, 16500), (1, 2, 1, 2100, 16384),
                                                         (2, 36, 4, 300, 16500)])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_sm90_causal_wide_tiles(batch, heads_q, heads_kv, nq, nk, dtype):
    """Causal calls from 16K keys take 176-key tiles at d=128 (forward_traits.h): the diagonal
    inside a wide tile, and (16500 = 93 x 176 + 132) a last tile only partly filled; the last
    case has 216 query blocks, so the persistent blocks take several each."""
    check_cuda(Case(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=nq, seqlen_k=nk,
                    head_dim=128, dtype=dtype, is_causal=True))


def test_sm90_agrees_with_sm80(monkeypatch):
    case = Case(batch=2, heads_q=8, heads_kv=2, seqlen_q=300, seqlen_k=517, head_dim=128,
                dtype=torch.float16, is_causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    out90, lse90 = torch.ops.fusedattn.forward(q, k, v, None, True, None)
    monkeypatch.setenv("FUSEDATTN_KERNEL_FAMILY", "sm80")
    out80, lse80 = torch.ops.fusedattn.forward(q, k, v, None, True, None)
    torch.testing.assert_close(out90, out80, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse90, lse80, atol=1e-4, rtol=1e-5)
    check_forward(case, device="cuda", out=out90, lse=lse90)


@pytest.mark.parametrize("mask", [m for m in MASK_KINDS if m != "none"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_sm90_every_mask_kind(mask, is_causal, dtype):
    """attn_mask on the sm90 path (head dim 128): Nk = 800 spans several key tiles."""
    check_cuda(Case(seqlen_q=113, seqlen_k=800, head_dim=128, dtype=dtype, mask=mask, is_causal=is_causal))


@given(cases(max_len=700), st.sampled_from(GPU_DTYPES))
def test_sm90_random_cases_at_head_dim_128(case, dtype):
    """The random cases, every mask kind among them, at the head dim that takes masks."""
    check_cuda(dataclasses.replace(case, dtype=dtype, head_dim=128))


def test_sm90_refuses_what_it_cannot_take():
    q, k, v, _ = make_inputs(Case(dtype=torch.float16, head_dim=32), "cuda")
    with pytest.raises(RuntimeError, match="head dims 64 and 128, attn_mask at head dim 128 only, and without a mask "
                       "a scale of at least 1.17549e-38; got head dim 32, scale 0.17"):
        torch.ops.fusedattn.forward(q, k, v)
    q, k, v, mask = make_inputs(Case(dtype=torch.float16, head_dim=64, mask="bool"), "cuda")
    with pytest.raises(RuntimeError, match="got head dim 64 with a mask"):
        torch.ops.fusedattn.forward(q, k, v, mask)
    q, k, v, _ = make_inputs(Case(dtype=torch.float16, head_dim=128), "cuda")
    for scale in (-0.5, 1e-39):  # negative; below FLT_MIN (flushed to 0 by the kernels' fast math)
        with pytest.raises(RuntimeError, match=f"got head dim 128, scale {scale:g}"):
            torch.ops.fusedattn.forward(q, k, v, None, False, scale)


def test_sm90_strided_operands():
    """Strides the tensor maps take: q in [B, N, H, d] memory, k rows 128 elements apart."""
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=200, seqlen_k=333, head_dim=64,
                dtype=torch.bfloat16, is_causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_wide = torch.cat([k, torch.randn_like(k)], dim=-1)[..., :64]
    out, lse = torch.ops.fusedattn.forward(q_t, k_wide, v, None, True, None)
    check_forward(case, device="cuda", out=out, lse=lse)


def test_sm90_declines_what_tensor_maps_cannot_describe(monkeypatch):
    """k and v broadcast over heads (stride 0): the sm80 kernel takes the call
    unless sm90 is forced, which is an error that says why."""
    q = torch.randn(2, 4, 150, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 1, 150, 128, device="cuda", dtype=torch.float16).expand(2, 4, 150, 128)
    v = torch.randn(2, 1, 150, 128, device="cuda", dtype=torch.float16).expand(2, 4, 150, 128)
    with pytest.raises(RuntimeError, match="tensor memory accelerator cannot describe"):
        torch.ops.fusedattn.forward(q, k, v, None, False, None)
    monkeypatch.setenv("FUSEDATTN_KERNEL_FAMILY", "auto")
    out, _ = torch.ops.fusedattn.forward(q, k, v, None, False, None)
    ref = fusedattn.reference.attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)
