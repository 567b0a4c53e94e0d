"""What the CUDA tests share: dtypes, head dims, the families this machine has,
and inputs that catch unwritten outputs and misaligned operands."""

import functools

import pytest
import torch

import fusedattn
from fusedattn.ops import cuda_head_dims

from .attention_cases import Case, check_backward, check_forward, default_grad_out, make_inputs, make_sinks

GPU_DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = list(cuda_head_dims())


@functools.cache
def sm90_available() -> bool:
    """Whether this build and GPU have the sm90 family (the planner's answer for a call it takes)."""
    if not torch.cuda.is_available() or not HEAD_DIMS:
        return False
    q = torch.zeros(1, 1, 1, 64, device="cuda", dtype=torch.float16)
    with fusedattn.backends.force("auto"):
        return fusedattn.plan(q, q, q)["family"] == "sm90"


def poison_allocator(*shapes_and_dtypes) -> None:
    """Frees NaN-filled blocks of exactly the outputs' sizes, so the caching
    allocator hands them to the next call's outputs: an element the kernel
    never writes then fails the NaN check."""
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device="cuda")
              for shape, dtype in shapes_and_dtypes]
    del blocks


def at_odd_offset(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data starts one element past a 16-byte
    boundary (contiguous() of it is itself: the operators must copy it)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape).copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


def forward(q, k, v, attn_mask=None, is_causal=False, scale=None, window=None, softcap=None, sinks=None):
    """torch.ops.fusedattn.forward with the family that fusedattn.backends.force set."""
    return torch.ops.fusedattn.forward(q, k, v, attn_mask, is_causal, scale, fusedattn.backends.forced().family,
                                       window, softcap, sinks)


def backward(grad_out, q, k, v, out, lse, attn_mask=None, is_causal=False, scale=None, window=None, softcap=None,
             sinks=None):
    """torch.ops.fusedattn.backward with the family that fusedattn.backends.force set."""
    return torch.ops.fusedattn.backward(grad_out, q, k, v, out, lse, attn_mask, is_causal, scale,
                                        fusedattn.backends.forced().family, window, softcap, sinks)


def served_head_dims(backward: bool = False) -> tuple[int, ...]:
    """The forward's (or backward's) served head dims on this GPU: sm80's, and
    for the backward those only sm90 has (above 128) where the GPU has sm90."""
    if not backward:
        return cuda_head_dims("sm80_forward")
    wide = cuda_head_dims("sm90_backward") if sm90_available() else ()
    return tuple(sorted(set(cuda_head_dims("sm80_backward")) | set(wide)))


def kernel_head_dim(case: Case, backward: bool = False) -> int | None:
    """The head dim the CUDA kernels run the case at: the next of the forward's
    (or backward's) served dims at least d and d_v; None above the largest."""
    widest = max(case.head_dim, case.head_dim_v or case.head_dim)
    return min((d for d in served_head_dims(backward) if d >= widest), default=None)


def planned(case: Case, q, k, v, mask, backward: bool = False) -> dict | None:
    """The plan the planner gives the call: on the forced family if one is
    forced, which the plan must then say, at the next served head dim at least
    d and d_v. None where a forced family refuses the call; then the call
    itself must raise, not fall back."""
    forced = fusedattn.backends.forced().family
    try:
        plan = fusedattn.plan(q, k, v, mask, case.is_causal, case.scale, backward=backward, window=case.window,
                              softcap=case.softcap, sinks=make_sinks(case, q.device))
    except RuntimeError as e:
        assert forced is not None and "was forced, but" in str(e), str(e)
        return None
    assert plan["family"] == (forced or plan["family"]) and plan["family"] in ("sm80", "sm90"), plan
    assert plan["head_dim"] == kernel_head_dim(case, backward), plan
    return plan


def check_cuda(case: Case):
    """check_forward on CUDA, the outputs' memory poisoned first, on the
    planned (or forced) family; a forced family that refuses must raise."""
    q, k, v, mask = make_inputs(case, "cuda")
    options = (case.is_causal, case.scale, case.window, case.softcap, make_sinks(case, "cuda"))
    plan = planned(case, q, k, v, mask)
    if plan is None:
        with pytest.raises(RuntimeError, match="was forced, but"):
            forward(q, k, v, mask, *options)
        return None
    padded = (*q.shape[:3], plan["head_dim"])  # out before it is cut back to d_v
    poison_allocator((q.shape[:3] + v.shape[3:], q.dtype), (padded, q.dtype), (q.shape[:3], torch.float32))
    out, lse = forward(q, k, v, mask, *options)
    return check_forward(case, device="cuda", out=out, lse=lse)


def check_cuda_backward(case: Case):
    """check_backward on CUDA with NaN-filled blocks of the gradients' and
    workspaces' sizes freed just before, so an element never written fails;
    the backward's plan as for check_cuda."""
    q, k, v, mask = make_inputs(case, "cuda")
    plan = planned(case, q, k, v, mask, backward=True)
    if plan is None:
        q.requires_grad_(True)
        with pytest.raises(RuntimeError, match="was forced, but"):
            fusedattn.attention(q, k, v, mask, *case.options(make_sinks(case, "cuda"))).sum().backward()
        return
    q_shape = (case.batch, case.heads_q, case.seqlen_q, plan["head_dim"])  # the kernels' (padded) gradients
    kv_shape = (case.batch, case.heads_kv, case.seqlen_k, plan["head_dim"])

    def poison_gradients():
        poison_allocator(*[(q_shape, case.dtype)] * 3, *[(kv_shape, case.dtype)] * 2, (q_shape, torch.float32),
                         (q_shape[:3], torch.float32))

    if planned(case, q, k, v, mask) is not None:
        poison_gradients()
        check_backward(case, device="cuda")
        return
    # The forced family takes the backward but not the forward: the forced
    # call raises, so the forward runs unforced, then the forced backward
    # operator itself.
    sinks = make_sinks(case, "cuda")
    is_causal, scale, window, softcap, sinks = case.options(sinks)
    with pytest.raises(RuntimeError, match="was forced, but"):
        forward(q, k, v, mask, is_causal, scale, window, softcap, sinks)
    with fusedattn.backends.force("auto"):
        out, lse = forward(q, k, v, mask, is_causal, scale, window, softcap, sinks)
    grad_out = default_grad_out(case, "cuda")
    poison_gradients()
    grads = backward(grad_out, q, k, v, out, lse, mask, is_causal, scale, window, softcap, sinks)
    check_backward(case, device="cuda", grads=grads if sinks is not None else grads[:3], grad_out=grad_out)
