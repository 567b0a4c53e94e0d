"""What only the sm90 (wgmma) backward has, against autograd of the float64
reference (marker `gpu`; the family forced, skipped where the build or GPU
lacks it). The features every family serves are tested per family in
test_backward.py."""

import threading

import pytest
import torch

import fusedattn
from helpers.attention_cases import Case, check_backward, check_forward, make_inputs
from helpers.cuda import HEAD_DIMS, backward, check_cuda_backward, forward

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("sm90")]
SM90_HEAD_DIMS = [d for d in HEAD_DIMS if d in fusedattn.ops.cuda_head_dims("sm90_backward")]


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


def test_sm90_runs_on_a_thread_that_made_no_cuda_call():
    """A thread has no CUDA context until a runtime call binds one, and the
    tensor maps come from a driver call, which needs one (autograd's backward
    thread is such a thread). The forward and the backward, each the first
    CUDA work of a fresh thread."""
    case = Case(dtype=torch.float16, head_dim=64, seqlen_q=77, seqlen_k=130, is_causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    out, lse = forward(q, k, v, None, True, None)
    grad_out = torch.randn_like(out)
    torch.cuda.synchronize()
    calls = {"forward": lambda: torch.ops.fusedattn.forward(q, k, v, None, True, None, "sm90"),
             "backward": lambda: torch.ops.fusedattn.backward(grad_out, q, k, v, out, lse, None, True, None, "sm90")}
    results = {}

    def run(name):
        try:
            results[name] = calls[name]()
        except Exception as e:  # re-raised below, in the test's thread
            results[name] = e

    for name in calls:
        thread = threading.Thread(target=run, args=(name,))
        thread.start()
        thread.join()
    for result in results.values():
        if isinstance(result, Exception):
            raise result
    check_forward(case, device="cuda", out=results["forward"][0], lse=results["forward"][1])
    check_backward(case, device="cuda", grads=results["backward"], grad_out=grad_out)


@pytest.mark.parametrize("n", [2048, 4096])
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
def test_sm90_backward_long_sequences(n, head_dim):
    check_cuda_backward(Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=n, seqlen_k=n, head_dim=head_dim,
                             dtype=torch.bfloat16, is_causal=True))


@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
def test_sm90_backward_agrees_with_sm80(head_dim):
    case = Case(batch=2, heads_q=8, heads_kv=2, seqlen_q=300, seqlen_k=517, head_dim=head_dim,
                dtype=torch.float16, is_causal=True)
    q, k, v, _ = make_inputs(case, "cuda", requires_grad=True)
    grad_out = torch.randn_like(q)
    assert fusedattn.plan(q, k, v, None, True, backward=True)["family"] == "sm90"
    grads90 = torch.autograd.grad(fusedattn.attention(q, k, v, None, True), (q, k, v), grad_out)
    with fusedattn.backends.force("sm80"):
        assert fusedattn.plan(q, k, v, None, True, backward=True)["family"] == "sm80"
        grads80 = torch.autograd.grad(fusedattn.attention(q, k, v, None, True), (q, k, v), grad_out)
    for a, b in zip(grads90, grads80):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    check_backward(case, device="cuda", grads=grads90, grad_out=grad_out)


def test_sm90_backward_declines_what_tensor_maps_cannot_describe():
    """A grad_out broadcast from one row has strides of 0 (autograd hands the
    operator a contiguous copy; a direct call need not): the planner gives it
    to sm80 unless sm90 is forced, which is an error that says why."""
    case = Case(dtype=torch.float16, head_dim=128, seqlen_q=100, seqlen_k=150, is_causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    out, lse = forward(q, k, v, None, True, None)
    grad_out = torch.randn(1, 1, 1, case.head_dim, device="cuda", dtype=case.dtype).expand_as(q)
    args = (grad_out, q, k, v, out, lse, None, True, None)
    with pytest.raises(RuntimeError, match="tensor memory accelerator cannot describe grad_out: its byte strides"):
        backward(*args)
    with fusedattn.backends.force("auto"):
        check_backward(case, device="cuda", grads=backward(*args), grad_out=grad_out)

