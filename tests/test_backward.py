"""The backward's features on every backend (the `backend` fixture: cpu, and
the sm80 and sm90 families with marker `gpu`) against autograd of the float64
reference (3x rule). What only CUDA's backward has is in
test_backward_cuda.py and test_backward_sm90.py."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fusedattn
from helpers.attention_cases import DTYPES, MASK_KINDS, Case, cases, make_inputs
from helpers.kernel_table import FEATURE_HEAD_DIMS


@given(st.data())
# (@given fills the rightmost parameters; the backend holds for every example)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_backward_random_cases(backend, data):
    if backend.device == "cpu":
        case = data.draw(cases(max_len=200))
    else:
        case = dataclasses.replace(data.draw(cases(max_len=400)), dtype=data.draw(st.sampled_from(backend.dtypes)),
                                   head_dim=data.draw(st.sampled_from(FEATURE_HEAD_DIMS)))
    backend.check_backward(case)


@pytest.mark.parametrize("mask", MASK_KINDS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", FEATURE_HEAD_DIMS)
def test_backward_every_mask_kind(backend, mask, is_causal, dtype, head_dim):
    # Nk = 800 reaches past the key_block_holes mask's hidden tiles.
    backend.check_backward(Case(seqlen_q=113, seqlen_k=800, head_dim=head_dim, dtype=dtype, mask=mask,
                                is_causal=is_causal))


@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 1025), (7, 300), (300, 7), (97, 113), (129, 64), (257, 256),
                                   (1025, 97), (1025, 1025), (2048, 1000)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", FEATURE_HEAD_DIMS)
def test_backward_awkward_lengths(backend, nq, nk, is_causal, head_dim):
    # The CPU takes one batch of 2/1 heads (the float64 reference is the cost there) and
    # leaves 2048 x 1000 to CUDA.
    if backend.device == "cpu" and nq * nk > 2_000_000:
        pytest.skip("2048 x 1000 runs on CUDA only: the float64 reference on the CPU is slow")
    batch, heads_q, heads_kv = (1, 2, 1) if backend.device == "cpu" else (2, 4, 2)
    backend.check_backward(Case(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=nq, seqlen_k=nk,
                                head_dim=head_dim, dtype=backend.primary_dtype, is_causal=is_causal))


@pytest.mark.parametrize("heads", [(8, 1), (6, 2), (4, 4)], ids=["mqa", "gqa", "mha"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_grouped_query_heads(backend, heads, dtype):
    backend.check_backward(Case(heads_q=heads[0], heads_kv=heads[1], seqlen_q=300, seqlen_k=520, head_dim=64,
                                dtype=dtype, is_causal=True, mask="key_padding"))


@pytest.mark.parametrize("head_dim", [1, 24, 32, 64, 128, 256])
def test_backward_head_dims(backend, head_dim):
    backend.check_backward(Case(head_dim=head_dim, seqlen_q=65, seqlen_k=130, dtype=backend.primary_dtype,
                                mask="additive"))


def test_fully_masked_rows_get_zero_gradient(backend):
    case = Case(mask="fully_masked_rows", dtype=backend.primary_dtype, head_dim=64, seqlen_q=130, seqlen_k=200)
    q, k, v, mask = backend.inputs(case, requires_grad=True)
    backend.require_plan(q, k, v, mask, backward=True)
    fusedattn.attention(q, k, v, mask).backward(torch.randn_like(q))
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
    with torch.no_grad():  # nothing is recorded, so the mask's requires_grad does not matter
        assert fusedattn.attention(q, k, v, mask).shape == q.shape


def test_a_double_backward_raises_rather_than_giving_zero():
    q, k, v, _ = make_inputs(Case(), requires_grad=True)
    out = fusedattn.attention(q, k, v)
    (grad_q,) = torch.autograd.grad(out.square().sum(), q)  # once: fine
    assert grad_q.abs().sum() > 0
    with pytest.raises(RuntimeError, match="double backward, create_graph=True, is not supported"):
        torch.autograd.grad(fusedattn.attention(q, k, v).square().sum(), k, create_graph=True)


def test_a_backward_where_only_out_is_used_and_one_where_neither_is():
    q, k, v, _ = make_inputs(Case(), requires_grad=True)
    out, lse = torch.ops.fusedattn.forward(q, k, v)
    (grad_q,) = torch.autograd.grad(out.sum() + lse.sum(), q)  # lse adds no gradient
    (expected,) = torch.autograd.grad(fusedattn.attention(q, k, v).sum(), q)
    torch.testing.assert_close(grad_q, expected, atol=0, rtol=0)
