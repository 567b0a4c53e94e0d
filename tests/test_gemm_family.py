"""The gemm family: attention from float32 matrix products, a block of query
rows at a time (cpp/ops/gemm_attention.h). Forced, on the CPU and on CUDA,
against the float64 reference: every mask kind, windows, soft-capping, sinks,
grouped heads, a value head dim of its own, awkward and empty lengths, more
than one block of rows, packed sequences, forward and backward. On CUDA the planner gives it
what no fused kernel takes (float32, head dims past the kernels'; for the
KV cache, what the decode kernel is not built for): those plans, their accuracy against SDPA's float32, and the errors of
a fused family forced on them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fusedattn
from helpers.attention_cases import MASK_KINDS, Case, check_backward, check_forward, make_inputs, make_sinks, max_err
from helpers.cuda import forward, sm90_available
from helpers.kvcache_cases import check_against_reference, check_packed_kvcache, make_cache
from helpers.varlen_cases import check_varlen, check_varlen_backward, packed

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """The gemm family forced on each device in turn."""
    with fusedattn.backends.force("gemm"):
        yield request.param


def gemm_plan(case: Case, device: str, backward: bool = False) -> dict:
    q, k, v, mask = make_inputs(case, device)
    plan = fusedattn.plan(q, k, v, mask, case.is_causal, case.scale, backward=backward, window=case.window,
                          softcap=case.softcap, sinks=make_sinks(case, device))
    assert plan["family"] == "gemm" and plan["head_dim"] == case.head_dim, plan
    assert plan["block_n"] == case.seqlen_k, plan
    return plan


def check_gemm(case: Case, device: str, backward: bool = True) -> None:
    """The forward (its out and lse) and, with `backward`, the gradients, each plan asserted."""
    gemm_plan(case, device)
    q, k, v, mask = make_inputs(case, device)
    out, lse = forward(q, k, v, mask, *case.options(make_sinks(case, device)))
    check_forward(case, device, out=out, lse=lse)
    if backward:
        assert gemm_plan(case, device, backward=True)["deterministic"]
        check_backward(case, device)


@pytest.mark.parametrize("mask", MASK_KINDS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_every_mask_kind(device, mask, is_causal):
    check_gemm(Case(seqlen_q=113, seqlen_k=300, head_dim=32, mask=mask, is_causal=is_causal), device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [(0, 0), (20, -1), (-1, 7), (30, 5), (5000, 5000)], ids=str)
def test_windows(device, dtype, window):
    check_gemm(Case(seqlen_q=97, seqlen_k=150, head_dim=48, dtype=dtype, window=window, mask="key_padding"), device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap", [None, 0.5, 30.0], ids=str)
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_soft_capping_and_sinks(device, dtype, softcap, sinks):
    """With rows that see nothing (out 0; with a sink, the sink takes the mass)."""
    check_gemm(Case(seqlen_q=90, seqlen_k=130, head_dim=64, dtype=dtype, mask="fully_masked_rows", is_causal=True,
                    softcap=softcap, sinks=sinks), device)


@pytest.mark.parametrize("heads", [(8, 1), (6, 2), (4, 4)], ids=["mqa", "gqa", "mha"])
@pytest.mark.parametrize("dims", [(1, 1), (40, 24), (96, 160), (256, 256), (300, 64)], ids=str)
def test_heads_and_head_dims(device, heads, dims):
    """Any head dim, and v's of its own: nothing is padded."""
    check_gemm(Case(heads_q=heads[0], heads_kv=heads[1], seqlen_q=65, seqlen_k=77, head_dim=dims[0],
                    head_dim_v=dims[1], mask="additive"), device)


@pytest.mark.parametrize("lengths", [(1, 1), (1, 200), (200, 1), (0, 50), (50, 0), (0, 0)], ids=str)
def test_awkward_and_empty_lengths(device, lengths):
    """No keys: out 0, lse -inf, zero gradients; no queries: empty outputs."""
    check_gemm(Case(seqlen_q=lengths[0], seqlen_k=lengths[1], head_dim=32, is_causal=True, sinks=True), device)


def test_blocks_of_rows(device):
    """More rows than a block's scores hold: the blocks meet without seams
    (causal, a window, a mask, soft-capping and sinks across them)."""
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=700, seqlen_k=1000, head_dim=32, mask="bool",
                window=(300, 40), softcap=5.0, sinks=True)
    if device == "cuda":  # the GPU's blocks are 2^26 scores
        case = dataclasses.replace(case, batch=1, heads_q=8, seqlen_q=2100, seqlen_k=8192, mask="key_padding")
    plan = gemm_plan(case, device)
    assert plan["block_m"] < case.seqlen_q, plan
    check_gemm(case, device)


def test_opcheck(device):
    case = Case(mask="additive", is_causal=True, head_dim=24)
    q, k, v, mask = make_inputs(case, device)
    torch.library.opcheck(torch.ops.fusedattn.forward.default, (q, k, v, mask, True, None, "gemm"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", [{}, {"is_causal": True, "softcap": 3.0}, {"window": (40, 5)}], ids=str)
def test_packed_sequences(device, dtype, options):
    """attention_varlen a sequence at a time (lengths 0 and 1 included), forward and backward."""
    lengths_q, lengths_k = [70, 0, 1, 130, 33], [90, 12, 1, 130, 0]
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(5))
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, dtype=dtype, device=device)
    plan = fusedattn.plan_varlen(q, k, v, cu_q, cu_k, backward=True, **options)
    assert plan["family"] == "gemm" and plan["varlen"] and plan["block_n"] == max(lengths_k), plan
    check_varlen(lengths_q, lengths_k, dtype=dtype, sinks=sinks.to(device), device=device, **options)
    check_varlen_backward(lengths_q, lengths_k, dtype=dtype, sinks=sinks, device=device, **options)


def test_an_unknown_family_names_it():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="family must be None, 'auto', 'cpu' or 'gemm' for cpu tensors, got 'tpu'"):
        torch.ops.fusedattn.forward(q, q, q, None, False, None, "tpu")


@pytest.mark.gpu
def test_cuda_plans_it_where_no_kernel_serves():
    """float32, a head dim past the forward's kernels, the backward past its
    kernels': the gemm family; what the kernels take (soft-capped calls too)
    stays on them; a fused family forced on the rest says why it cannot."""
    def plan(dtype=torch.float16, d=64, backward=False, softcap=None):
        q = torch.randn(1, 2, 40, d, device="cuda", dtype=dtype)
        return fusedattn.plan(q, q, q, backward=backward, softcap=softcap)["family"]

    with fusedattn.backends.force("auto"):
        assert plan(torch.float32) == plan(torch.float32, backward=True) == "gemm"
        assert plan(d=300) == plan(d=300, backward=True) == "gemm"
        # d=256's backward: sm90's wide kernel where the GPU has it; no sm80 kernel.
        assert plan(d=256, backward=True) == ("sm90" if sm90_available() else "gemm")
        assert plan() in ("sm80", "sm90") and plan(d=256) in ("sm80", "sm90")
        assert plan(softcap=5.0) != "gemm" and plan(softcap=5.0, backward=True) != "gemm"
    q = torch.randn(1, 2, 40, 64, device="cuda")
    with fusedattn.backends.force("sm80"), pytest.raises(
            RuntimeError, match="family sm80 was forced, but the CUDA kernels take float16 and bfloat16, got float32"):
        fusedattn.attention(q, q, q)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
def test_cuda_float32_is_as_accurate_as_sdpa(is_causal):
    """float32 on CUDA: out and the gradients within 2x the error of SDPA's
    float32 path against float64 (plus float32's own rounding floor)."""
    case = Case(batch=2, heads_q=8, heads_kv=8, seqlen_q=1000, seqlen_k=1000, head_dim=128, is_causal=is_causal)
    q, k, v, _ = make_inputs(case, "cuda", requires_grad=True)
    grad = torch.randn_like(q)

    def errors(attend):
        out = attend(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        out64 = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=is_causal)
        grads64 = torch.autograd.grad(out64, (q64, k64, v64), grad.double())
        return [max_err(a, b) for a, b in zip((out, *grads), (out64, *grads64))]

    assert fusedattn.plan(q, k, v, backward=True)["family"] == "gemm"
    ours = errors(lambda q, k, v: fusedattn.attention(q, k, v, is_causal=is_causal))
    sdpa = errors(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal))
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, sdpa):
        assert a <= 2 * b + 1e-6, f"{name}: error {a:.3g} against SDPA's {b:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,d_v", [(torch.float32, 64, 64), (torch.float16, 80, 80), (torch.bfloat16, 64, 48)],
                         ids=str)
def test_cuda_kvcache_calls_the_decode_kernel_does_not_take(dtype, d, d_v):
    """float32, a head dim the decode kernel is not built for, v's head dim of
    its own: the gemm family a sequence at a time, appending in place as the
    kernel does; the decode kernel's overrides are refused."""
    q, k_cache, v_cache, lens, k_new, v_new = (t.cuda() for t in make_cache(B=3, d=d, d_v=d_v, nq=2, n_new=2,
                                                                              dtype=dtype))
    assert fusedattn.plan_kvcache(q, k_cache, v_cache)["family"] == "gemm"
    out, lse = torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, lens, k_new, v_new, True)
    check_against_reference(q, k_cache, v_cache, lens, k_new, v_new, True, out, lse)
    with pytest.raises(RuntimeError, match="this call runs on the gemm family"):
        torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, lens, None, None, True, num_splits=2)


@pytest.mark.gpu
def test_cuda_packed_calls_the_kernels_do_not_take():
    """float32 packed sequences plan the gemm family by themselves (a forced
    sm80 says why it cannot), and packed queries against float32 and d=40
    caches run on it too, appending in place."""
    q, k, v, cu_q, cu_k = packed([30, 0, 50], [40, 5, 50], device="cuda")
    assert fusedattn.plan_varlen(q, k, v, cu_q, cu_k, is_causal=True, backward=True)["family"] == "gemm"
    check_varlen_backward([30, 0, 50], [40, 5, 50], is_causal=True, device="cuda")
    with fusedattn.backends.force("sm80"), pytest.raises(
            RuntimeError, match="family sm80 was forced, but the CUDA kernels take float16 and bfloat16, got float32"):
        fusedattn.attention_varlen(q, k, v, cu_q, cu_k)
    for dtype, d in ((torch.float32, 64), (torch.float16, 40)):
        check_packed_kvcache([5, 1, 40], [100, 1, 0], d=d, max_len=256, dtype=dtype, device="cuda", seed=4)
