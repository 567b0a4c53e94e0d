"""The sm90 backward above d=128 (cpp/cuda/sm90/backward_wide_kernel.cuh):
d=192 and 256 and the dims padded to them (d_v != d included), full, causal and
windowed, grouped heads with and without head splits, packed sequences,
against the float64 reference with the plan asserted; and where the planner
sends what it does not take (attn_mask, soft-capping, the deterministic
mode at d=256, sm80): to the gemm family, or a forced family's error."""

import contextlib

import pytest
import torch

import fusedattn
from fusedattn.bench import _deterministic_algorithms as deterministic
from helpers.attention_cases import Case, assert_within_rule, check_backward, make_inputs, stored_output_error
from helpers.cuda import check_cuda_backward, sm90_available
from helpers.varlen_cases import check_varlen_backward, packed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not sm90_available(), reason="this build or GPU has no sm90 kernels")]

CALLS = {"full": {}, "causal": {"is_causal": True}, "window": {"window": (70, 9)}, "causal-window": {
    "is_causal": True, "window": (100, 0)}}


def backward_plan(case: Case) -> dict:
    q, k, v, mask = make_inputs(case, "cuda")
    return fusedattn.plan(q, k, v, mask, case.is_causal, case.scale, backward=True, window=case.window,
                          softcap=case.softcap)


@pytest.mark.parametrize("d,d_v", [(192, 192), (160, 160), (192, 128), (136, 72), (256, 256), (200, 256),
                                   (256, 128)], ids=str)
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_wide_backward_matches_reference(sm90, d, d_v, call, dtype):
    # Nq, Nk not multiples of the 64-query steps or 64-key blocks; GQA 6:2.
    case = Case(heads_q=6, heads_kv=2, seqlen_q=190, seqlen_k=260, head_dim=d, head_dim_v=d_v, dtype=dtype,
                seed=d + d_v, **CALLS[call])
    plan = backward_plan(case)
    kernel_dim = 192 if max(d, d_v) <= 192 else 256
    assert (plan["family"], plan["head_dim"], plan["block_m"], plan["block_n"]) == ("sm90", kernel_dim, 64, 64), plan
    check_cuda_backward(case)


@pytest.mark.parametrize("heads", [(8, 1), (4, 4)], ids=["mqa-split", "mha"])
@pytest.mark.parametrize("d", [192, 256])
def test_wide_backward_head_splits(heads, d):
    """One short sequence of MQA spreads its 8 query heads over blocks (float32
    sums of dK and dV, added by atomics); MHA writes dK and dV directly."""
    case = Case(batch=1, heads_q=heads[0], heads_kv=heads[1], seqlen_q=300, seqlen_k=200, head_dim=d,
                dtype=torch.bfloat16, is_causal=True)
    plan = backward_plan(case)
    assert plan["family"] == "sm90" and (plan["head_splits"] > 1) == (heads[1] == 1), plan
    check_cuda_backward(case)


@pytest.mark.parametrize("d", [192, 256])
def test_wide_backward_long_sequence_and_unit_rows(d):
    """Many 64-query steps per block (the ring's phases over a long walk), and Nq = Nk = 1."""
    check_cuda_backward(Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=1500, seqlen_k=1100, head_dim=d,
                             dtype=torch.float16, is_causal=True))
    check_cuda_backward(Case(batch=3, seqlen_q=1, seqlen_k=1, head_dim=d, dtype=torch.bfloat16))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [192, 256])
def test_wide_backward_packed_sequences(is_causal, d):
    lengths_q, lengths_k = [5, 0, 1, 200, 3, 130, 64, 700], [5, 9, 1, 140, 0, 260, 64, 700]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, d=d, dtype=torch.float16, device="cuda")
    plan = fusedattn.plan_varlen(q, k, v, cu_q, cu_k, is_causal=is_causal, backward=True)
    assert plan["family"] == "sm90" and plan["block_n"] == 64 and plan["varlen"], plan
    check_varlen_backward(lengths_q, lengths_k, is_causal=is_causal, dtype=torch.float16, d=d, hq=4, hkv=2,
                          device="cuda", seed=5)


@pytest.mark.parametrize("option", ["mask", "softcap", "deterministic", "deterministic-softcap"])
def test_what_the_wide_backward_does_not_take_runs_on_the_gemm_family(option):
    # The deterministic mode's writers add staged dQ tiles, which d=256 has no room for.
    case = Case(seqlen_q=90, seqlen_k=70, head_dim=256 if option == "deterministic" else 192, dtype=torch.float16,
                is_causal=option != "mask", mask="additive" if option == "mask" else "none",
                softcap=2.0 if option.endswith("softcap") else None)
    with deterministic() if option.startswith("deterministic") else contextlib.nullcontext():
        assert backward_plan(case)["family"] == "gemm"
        check_backward(case, "cuda")
        q, k, v, mask = make_inputs(case, "cuda")
        with fusedattn.backends.force("sm90"), pytest.raises(RuntimeError, match="was forced, but the sm90 backward"):
            fusedattn.plan(q, k, v, mask, case.is_causal, backward=True, softcap=case.softcap)


def test_sm80_forced_at_a_wide_head_dim_is_an_error():
    case = Case(head_dim=192, dtype=torch.float16)
    q, k, v, _ = make_inputs(case, "cuda")
    with fusedattn.backends.force("sm80"):
        assert fusedattn.plan(q, k, v)["family"] == "sm80"  # the forward has d=192 on sm80
        with pytest.raises(RuntimeError, match=r"family sm80 was forced, but the sm80 backward has head dims"):
            fusedattn.plan(q, k, v, backward=True)


def test_supports_says_the_backward_is_fused_to_256_on_sm90():
    cuda = torch.device("cuda")
    assert fusedattn.ops.supports(cuda, torch.bfloat16, 192, fused=True)
    assert fusedattn.ops.supports(cuda, torch.bfloat16, 150, 256, fused=True)
    assert not fusedattn.ops.supports(cuda, torch.bfloat16, 192, softcap=True, fused=True)
    assert not fusedattn.ops.supports(cuda, torch.bfloat16, 264, fused=True)
    with deterministic():  # the wide kernel's deterministic mode at d=192; d=256: the gemm family
        assert fusedattn.ops.supports(cuda, torch.bfloat16, 192, fused=True)
        assert not fusedattn.ops.supports(cuda, torch.bfloat16, 256, fused=True)
        assert fusedattn.ops.supports(cuda, torch.bfloat16, 256, backward=False, fused=True)


def test_broadcast_operands_at_a_wide_head_dim_run_on_the_gemm_family():
    """k and v broadcast over the query heads (a stride of 0, which sm90's
    tensor maps do not take) at d=192: the gemm family, not an error."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 70, 192, generator=g).half().cuda().requires_grad_()
    k, v = (torch.randn(2, 1, 90, 192, generator=g).half().cuda().expand(2, 4, 90, 192).requires_grad_()
            for _ in range(2))
    assert fusedattn.plan(q, k, v, is_causal=True, backward=True)["family"] == "gemm"
    grad_out = torch.randn(q.shape, generator=g).half().cuda()
    grads = torch.autograd.grad(fusedattn.attention(q, k, v, is_causal=True), (q, k, v), grad_out)
    # The oracle in float64, the reference in float16, on the operands' values (k and v materialised).
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    inputs_low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    oracle, low = (torch.autograd.grad(fusedattn.reference.attention(*ts, is_causal=True), ts, dout)
                   for ts, dout in ((inputs64, grad_out.double()), (inputs_low, grad_out)))
    magnitude = max([1.0] + [o.abs().max().item() for o in oracle])
    # What a backward that reads the stored output cannot avoid, the gemm family's too (none for dv).
    extras = stored_output_error(*inputs64, grad_out.double(), (None, True, None, None, None, None), torch.float16)
    for name, got, o, lp, like, extra in zip(("dq", "dk", "dv"), grads, oracle, low, (q, k, v), extras):
        assert got.shape == like.shape and got.dtype == like.dtype
        assert_within_rule(name, got, o, lp, torch.float16, factor=3, scale=magnitude, extra=extra)
