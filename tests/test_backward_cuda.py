"""What only the CUDA backward has (marker `gpu`), against autograd of the
float64 reference (3x rule): strided and misaligned operands, empty sides,
agreement with the CPU, opcheck and torch.compile, the deterministic mode.
Features every backend serves are in test_backward.py."""

import pytest
import torch

import fusedattn
from helpers.attention_cases import Case, check_backward, make_inputs
from helpers.cuda import HEAD_DIMS, at_odd_offset, poison_allocator

pytestmark = pytest.mark.gpu


def test_cuda_backward_strided_inputs():
    """q laid out [B, N, H, d], k with a wide row stride, v on 2-byte-offset rows (copied)."""
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=130, head_dim=64,
                dtype=torch.float16, mask="bool", is_causal=True)
    q, k, v, mask = make_inputs(case, "cuda")
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    k_wide = torch.cat([k, torch.randn_like(k)], dim=-1)[..., :64].requires_grad_()
    v_off = torch.cat([torch.randn_like(v[..., :1]), v], dim=-1)[..., 1:].requires_grad_()
    grad_out = torch.randn_like(q)
    grads = torch.autograd.grad(fusedattn.attention(q_t, k_wide, v_off, mask, True), (q_t, k_wide, v_off),
                                grad_out)
    check_backward(case, device="cuda", grads=grads, grad_out=grad_out)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_backward_operands_at_odd_offsets(head_dim):
    """Every operand of the backward a contiguous view off 16 bytes (a direct
    call: autograd's out is the forward's own, aligned)."""
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=130, head_dim=head_dim,
                dtype=torch.bfloat16, is_causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    out, lse = torch.ops.fusedattn.forward(q, k, v, None, True, None)
    grad_out = torch.randn_like(q)
    grads = torch.ops.fusedattn.backward(*(at_odd_offset(t) for t in (grad_out, q, k, v, out)), lse, None,
                                         True, None)
    check_backward(case, device="cuda", grads=grads, grad_out=grad_out)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_cuda_backward_empty_sides(head_dim):
    """No queries: dK = dV = 0 (every key block still writes). No keys: dQ = 0.
    No sequences: empty gradients, on the planner's family (an empty batch
    has no tensor map, so sm90 does not take it)."""
    q, k, v, _ = make_inputs(Case(dtype=torch.float16, head_dim=head_dim), "cuda", requires_grad=True)
    empty = [t[:0].detach().requires_grad_() for t in (q, k, v)]
    assert fusedattn.plan(*empty, backward=True)["family"] == "sm80"
    grads = torch.autograd.grad(fusedattn.attention(*empty).sum(), empty)
    assert [g.shape for g in grads] == [t.shape for t in empty]
    poison_allocator((k.shape, k.dtype), (k.shape, k.dtype))
    dq, dk, dv = torch.autograd.grad(fusedattn.attention(q[:, :, :0], k, v).sum(), (q, k, v))
    assert (dk == 0).all() and (dv == 0).all() and dq.shape == q.shape
    poison_allocator((q.shape, q.dtype))
    out = fusedattn.attention(q, k[:, :, :0], v[:, :, :0])
    dq, = torch.autograd.grad(out, (q,), torch.randn_like(out))
    assert (dq == 0).all()


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


@pytest.mark.parametrize("is_causal,window", [(False, None), (True, None), (False, (40, 7)), (True, (100, 0))],
                         ids=["full", "causal", "window", "causal-window"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_cuda_backward_deterministic_mode(is_causal, window, head_dim):
    """Under torch.use_deterministic_algorithms(True) grad_q comes from its own
    pass: the same bits on every run, and within the rule of the reference
    (checked outside deterministic mode: the reference's cuBLAS calls would
    need CUBLAS_WORKSPACE_CONFIG inside it)."""
    case = Case(heads_q=4, heads_kv=2, seqlen_q=300, seqlen_k=333, head_dim=head_dim,
                dtype=torch.bfloat16, mask="key_padding", is_causal=is_causal, window=window,
                softcap=2.0 if is_causal else None)  # capped: sm80's capped key-block and dQ kernels
    q, k, v, mask = make_inputs(case, "cuda", requires_grad=True)
    grad_out = torch.randn_like(q)
    torch.use_deterministic_algorithms(True)
    try:
        plan = fusedattn.plan(q, k, v, mask, is_causal, backward=True, window=window, softcap=case.softcap)
        assert (plan["family"], plan["deterministic"]) == ("sm80", True), plan  # sm90's takes no attn_mask
        runs = [torch.autograd.grad(fusedattn.attention(q, k, v, mask, is_causal, window=window, softcap=case.softcap),
                                    (q, k, v), grad_out)
                for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
    check_backward(case, device="cuda", grads=runs[0], grad_out=grad_out)
