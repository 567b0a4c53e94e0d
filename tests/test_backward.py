"""Gradients on the CPU against autograd of the float64 reference (3x rule)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fusedattn
from helpers.attention_cases import MASK_KINDS, Case, check_backward, make_inputs
from test_forward import DTYPES, cases


@given(cases(max_len=200))
def test_backward_random_cases(case):
    check_backward(case)


@pytest.mark.parametrize("mask", MASK_KINDS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_every_mask_kind(mask, is_causal, dtype):
    check_backward(Case(seqlen_q=113, seqlen_k=97, dtype=dtype, mask=mask, is_causal=is_causal))


@pytest.mark.parametrize("nq,nk", [(1, 1), (7, 300), (300, 7), (257, 256), (1025, 97)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_backward_awkward_lengths(nq, nk, is_causal):
    check_backward(Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=nq, seqlen_k=nk, head_dim=64,
                        is_causal=is_causal))


@pytest.mark.parametrize("heads", [(8, 1), (6, 2)], ids=["mqa", "gqa"])
def test_backward_grouped_query_heads(heads):
    check_backward(Case(heads_q=heads[0], heads_kv=heads[1], seqlen_q=150, seqlen_k=260,
                        is_causal=True, mask="key_padding"))


@pytest.mark.parametrize("head_dim", [1, 24, 128, 256])
def test_backward_head_dims(head_dim):
    check_backward(Case(head_dim=head_dim, seqlen_q=65, seqlen_k=130, mask="additive"))


def test_fully_masked_rows_get_zero_gradient():
    case = Case(mask="fully_masked_rows")
    q, k, v, mask = make_inputs(case, requires_grad=True)
    fusedattn.attention(q, k, v, mask).sum().backward()
    hidden = ~mask.any(dim=-1)  # [B, Hq, Nq]
    assert hidden.any()
    assert (q.grad[hidden] == 0).all()
    assert not any(t.grad.isnan().any() for t in (q, k, v))


def test_directional_derivative_matches_finite_differences():
    """gradcheck-style: <grad, u> of the kernel equals the central difference
    of the float64 reference along a random direction u (the CPU kernel takes
    no float64, so torch.autograd.gradcheck itself cannot run on it)."""
    case = Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=9, seqlen_k=11, head_dim=8, mask="bool",
                is_causal=True)
    q, k, v, mask = make_inputs(case, requires_grad=True)
    w = torch.randn(q.shape, dtype=torch.float64)
    grads = torch.autograd.grad((fusedattn.attention(q, k, v, mask, True) * w).sum(), (q, k, v))
    directions = [torch.randn(t.shape, dtype=torch.float64) for t in (q, k, v)]

    def loss(step):
        q64, k64, v64 = (t.detach().double() + step * u for t, u in zip((q, k, v), directions))
        return (fusedattn.reference.attention(q64, k64, v64, mask, True) * w).sum().item()

    eps = 1e-4
    numeric = (loss(eps) - loss(-eps)) / (2 * eps)
    analytic = sum((g.double() * u).sum().item() for g, u in zip(grads, directions))
    assert abs(analytic - numeric) <= 1e-4 * max(1.0, abs(numeric)), (analytic, numeric)


def test_lse_only_downstream_has_no_gradient():
    q, k, v, _ = make_inputs(Case(), requires_grad=True)
    _, lse = torch.ops.fusedattn.forward(q, k, v)
    assert not lse.requires_grad


def test_mask_requiring_grad_is_refused():
    q, k, v, _ = make_inputs(Case(), requires_grad=True)
    mask = torch.zeros(q.shape[2], k.shape[2], requires_grad=True)
    with pytest.raises(RuntimeError, match="attn_mask"):
        fusedattn.attention(q, k, v, mask)
