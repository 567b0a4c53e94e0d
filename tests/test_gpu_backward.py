"""The CUDA backward against autograd of the float64 reference (3x rule;
marker `gpu`)."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fusedattn
from attention_cases import MASK_KINDS, Case, check_backward, make_inputs
from test_forward import cases
from test_gpu import GPU_DTYPES, HEAD_DIMS

pytestmark = pytest.mark.gpu


@given(cases(max_len=400), st.sampled_from(GPU_DTYPES), st.sampled_from(HEAD_DIMS))
def test_cuda_backward_random_cases(case, dtype, head_dim):
    check_backward(dataclasses.replace(case, dtype=dtype, head_dim=head_dim), device="cuda")


@pytest.mark.parametrize("mask", MASK_KINDS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_cuda_backward_every_mask_kind(mask, is_causal, dtype, head_dim):
    check_backward(Case(seqlen_q=113, seqlen_k=800, head_dim=head_dim, dtype=dtype, mask=mask,
                        is_causal=is_causal), device="cuda")


@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 1025), (7, 300), (300, 7), (97, 113), (129, 64),
                                   (1025, 1025), (2048, 1000)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_cuda_backward_awkward_lengths(nq, nk, is_causal, head_dim):
    check_backward(Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=nq, seqlen_k=nk, head_dim=head_dim,
                        dtype=torch.float16, is_causal=is_causal), device="cuda")


@pytest.mark.parametrize("heads", [(8, 1), (6, 2), (4, 4)], ids=["mqa", "gqa", "mha"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_cuda_backward_grouped_query_heads(heads, dtype):
    check_backward(Case(heads_q=heads[0], heads_kv=heads[1], seqlen_q=300, seqlen_k=520, head_dim=64,
                        dtype=dtype, is_causal=True, mask="key_padding"), device="cuda")


def test_cuda_backward_fully_masked_rows_and_cpu_agreement():
    case = Case(mask="fully_masked_rows", dtype=torch.bfloat16, head_dim=64, seqlen_q=130, seqlen_k=200)
    q, k, v, mask = make_inputs(case, "cuda", requires_grad=True)
    grad = torch.randn_like(q)
    fusedattn.attention(q, k, v, mask).backward(grad)
    hidden = ~mask.any(dim=-1)
    assert hidden.any() and (q.grad[hidden] == 0).all()
    assert not any(t.grad.isnan().any() for t in (q, k, v))
    qc, kc, vc = (t.detach().cpu().requires_grad_() for t in (q, k, v))
    fusedattn.attention(qc, kc, vc, mask.cpu()).backward(grad.cpu())
    for a, b in ((q, qc), (k, kc), (v, vc)):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=3e-2, rtol=3e-2)


def test_cuda_backward_opcheck_and_compile():
    case = Case(dtype=torch.float16, head_dim=64, mask="bool", is_causal=True)
    q, k, v, mask = make_inputs(case, "cuda")
    out, lse = torch.ops.fusedattn.forward(q, k, v, mask, True, None)
    torch.library.opcheck(torch.ops.fusedattn.backward.default,
                          (torch.randn_like(out), q, k, v, out, lse, mask, True, None))
    torch._dynamo.reset()
    q, k, v, _ = make_inputs(case, "cuda", requires_grad=True)
    f = torch.compile(lambda q, k, v: fusedattn.attention(q, k, v, is_causal=True).sum(), fullgraph=True)
    f(q, k, v).backward()
    expected = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    fusedattn.attention(q, k, v, is_causal=True).sum().backward()
    for a, t in zip(expected, (q, k, v)):
        torch.testing.assert_close(a, t.grad, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_cuda_backward_deterministic_mode(is_causal, head_dim):
    """Under torch.use_deterministic_algorithms(True) grad_q comes from its own
    pass: the same bits on every run, and within the rule of the reference."""
    case = Case(heads_q=4, heads_kv=2, seqlen_q=300, seqlen_k=333, head_dim=head_dim,
                dtype=torch.bfloat16, mask="key_padding", is_causal=is_causal)
    torch.use_deterministic_algorithms(True)
    try:
        check_backward(case, device="cuda")
        q, k, v, mask = make_inputs(case, "cuda", requires_grad=True)
        grad = torch.randn_like(q)
        runs = []
        for _ in range(3):
            runs.append(torch.autograd.grad(fusedattn.attention(q, k, v, mask, is_causal), (q, k, v), grad))
        for other in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
    finally:
        torch.use_deterministic_algorithms(False)
