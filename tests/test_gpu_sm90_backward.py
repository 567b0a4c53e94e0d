"""The sm90 (wgmma) backward against autograd of the float64 reference,
forced with FUSEDATTN_KERNEL_FAMILY=sm90 (marker `gpu`; skipped where the
build or the device has no sm90 kernels)."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fusedattn
from attention_cases import Case, check_backward, make_inputs
from test_forward import cases
from test_gpu import GPU_DTYPES
from test_gpu_backward import check_cuda_backward
from test_gpu_sm90 import SM90_HEAD_DIMS, sm90  # noqa: F401  (sm90: autouse, forces the family, skips without it)

pytestmark = pytest.mark.gpu


@given(cases(max_len=400), st.sampled_from(GPU_DTYPES), st.sampled_from(SM90_HEAD_DIMS))
def test_sm90_backward_random_cases(case, dtype, head_dim):
    check_cuda_backward(dataclasses.replace(case, dtype=dtype, head_dim=head_dim, mask="none"))


@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 1025), (7, 300), (300, 7), (97, 113), (129, 64),
                                   (1025, 1025), (2048, 1000)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_sm90_backward_awkward_lengths(nq, nk, is_causal, head_dim, dtype):
    check_cuda_backward(Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=nq, seqlen_k=nk, head_dim=head_dim,
                             dtype=dtype, is_causal=is_causal))


@pytest.mark.parametrize("heads", [(8, 1), (6, 2), (4, 4)], ids=["mqa", "gqa", "mha"])
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
def test_sm90_backward_grouped_query_heads(heads, head_dim):
    """MQA and GQA at batch 1: the group's query heads split over blocks (float32 dK/dV sums)."""
    check_cuda_backward(Case(heads_q=heads[0], heads_kv=heads[1], seqlen_q=300, seqlen_k=520,
                             head_dim=head_dim, dtype=torch.bfloat16, is_causal=True))


@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
def test_sm90_backward_strided_inputs(head_dim):
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=130, head_dim=head_dim,
                dtype=torch.float16, is_causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    k_wide = torch.cat([k, torch.randn_like(k)], dim=-1)[..., :head_dim].requires_grad_()
    v = v.requires_grad_()
    grad_out = torch.randn_like(q)
    grads = torch.autograd.grad(fusedattn.attention(q_t, k_wide, v, None, True), (q_t, k_wide, v), grad_out)
    check_backward(case, device="cuda", grads=grads, grad_out=grad_out)


@pytest.mark.parametrize("n", [2048, 4096])
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
def test_sm90_backward_long_sequences(n, head_dim):
    check_cuda_backward(Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=n, seqlen_k=n, head_dim=head_dim,
                             dtype=torch.bfloat16, is_causal=True))


@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
def test_sm90_backward_agrees_with_sm80(monkeypatch, head_dim):
    case = Case(batch=2, heads_q=8, heads_kv=2, seqlen_q=300, seqlen_k=517, head_dim=head_dim,
                dtype=torch.float16, is_causal=True)
    q, k, v, _ = make_inputs(case, "cuda", requires_grad=True)
    grad_out = torch.randn_like(q)
    grads90 = torch.autograd.grad(fusedattn.attention(q, k, v, None, True), (q, k, v), grad_out)
    monkeypatch.setenv("FUSEDATTN_KERNEL_FAMILY", "sm80")
    grads80 = torch.autograd.grad(fusedattn.attention(q, k, v, None, True), (q, k, v), grad_out)
    for a, b in zip(grads90, grads80):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    check_backward(case, device="cuda", grads=grads90, grad_out=grad_out)


def test_sm90_backward_declines_what_tensor_maps_cannot_describe(monkeypatch):
    """A grad_out broadcast from one row has strides of 0 (autograd hands the
    operator a contiguous copy; a direct call need not): the sm80 kernel takes
    it unless sm90 is forced, which is an error that says why."""
    case = Case(dtype=torch.float16, head_dim=128, seqlen_q=100, seqlen_k=150, is_causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    out, lse = torch.ops.fusedattn.forward(q, k, v, None, True, None)
    grad_out = torch.randn(1, 1, 1, case.head_dim, device="cuda", dtype=case.dtype).expand_as(q)
    args = (grad_out, q, k, v, out, lse, None, True, None)
    with pytest.raises(RuntimeError, match="tensor memory accelerator cannot describe"):
        torch.ops.fusedattn.backward(*args)
    monkeypatch.setenv("FUSEDATTN_KERNEL_FAMILY", "auto")
    check_backward(case, device="cuda", grads=torch.ops.fusedattn.backward(*args), grad_out=grad_out)


def test_sm90_backward_refuses_what_it_cannot_take():
    # (the sm90 forward takes a mask at d=128; its backward does not yet)
    q, k, v, mask = make_inputs(Case(dtype=torch.float16, head_dim=128, mask="bool"), "cuda", requires_grad=True)
    with pytest.raises(RuntimeError, match="takes no attn_mask"):
        fusedattn.attention(q, k, v, mask).sum().backward()
    q, k, v, _ = make_inputs(Case(dtype=torch.float16, head_dim=64), "cuda", requires_grad=True)
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="no deterministic mode"):
            fusedattn.attention(q, k, v).sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
