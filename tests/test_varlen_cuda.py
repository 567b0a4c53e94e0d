"""attention_varlen on CUDA: packed sequences through the kernels' work lists
(longest first), forward and backward on sm90 (where the GPU has it) and
sm80, against the float64 reference sequence by sequence; the plan (family,
work items) asserted for each call."""

import math

import pytest
import torch

import fusedattn
from fusedattn.ops import cuda_head_dims
from helpers.cuda import GPU_DTYPES, poison_allocator, sm90_available
from helpers.kvcache_cases import check_packed_kvcache, packed_cache
from helpers.varlen_cases import check_varlen, check_varlen_backward, packed

pytestmark = pytest.mark.gpu

# Empty sequences on either side, one token, Nq != Nk both ways, several tiles, a long one.
LENGTHS_Q = [5, 0, 1, 200, 3, 130, 64, 700]
LENGTHS_K = [5, 9, 1, 140, 0, 260, 64, 700]


def tiles(lengths, tile):
    return sum(math.ceil(n / tile) for n in lengths)


# "auto" takes sm90's forward where the GPU has it; "sm80" holds the Ampere kernels to the same cases.
FAMILIES = ["auto", "sm80"]


def assert_planned(lengths_q, lengths_k, backward=False, head_dim=64, **options):
    """The call runs the forced family (unforced: sm90 where it serves the head dim and options,
    else sm80) with one work item per query (key) tile."""
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, d=head_dim, dtype=torch.float16, device="cuda")
    plan = fusedattn.plan_varlen(q, k, v, cu_q, cu_k, backward=backward, **options)
    capped_dims = cuda_head_dims("sm90_backward" if backward else "sm90_forward_capped")
    sm90 = (sm90_available() and (options.get("softcap") is None or plan["head_dim"] in capped_dims)
            and not (backward and torch.are_deterministic_algorithms_enabled())
            and plan["head_dim"] in cuda_head_dims("sm90_backward" if backward else "sm90_forward"))
    expected = fusedattn.backends.forced().family or ("sm90" if sm90 else "sm80")
    assert plan["family"] == expected and plan["varlen"] and plan["schedule"] == "longest-first", plan
    tile, rows = (plan["block_n"], lengths_k) if backward else (plan["block_m"], lengths_q)
    assert plan["work_items"] == tiles(rows, tile), plan


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128, 40, 192, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_varlen_forward_matches_reference(family, dtype, d, is_causal):
    with fusedattn.backends.force(family):
        assert_planned(LENGTHS_Q, LENGTHS_K, head_dim=d, is_causal=is_causal)
        poison_allocator(((sum(LENGTHS_Q), 4, d), dtype), ((4, sum(LENGTHS_Q)), torch.float32))
        check_varlen(LENGTHS_Q, LENGTHS_K, is_causal=is_causal, dtype=dtype, d=d, device="cuda", seed=d)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("window", [None, (30, 0), (17, 40), (-1, 5)], ids=str)
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
def test_varlen_forward_grouped_heads_and_windows(family, heads, window, d):
    with fusedattn.backends.force(family):
        assert_planned(LENGTHS_Q, LENGTHS_K, head_dim=d, is_causal=window is None, window=window)
        check_varlen(LENGTHS_Q, LENGTHS_K, is_causal=window is None, window=window, dtype=torch.bfloat16,
                     hq=heads[0], hkv=heads[1], d=d, scale=0.2, device="cuda", seed=1)


@pytest.mark.parametrize("d,d_v", [(64, 32), (128, 96)], ids=str)
@pytest.mark.parametrize("softcap", [None, 2.5], ids=["sinks", "softcap-sinks"])
def test_varlen_forward_softcap_sinks_and_value_head_dim(softcap, d, d_v):
    """Sinks alone run sm90's forward (where the GPU has it); soft-capping sm90's
    at its capped head dims (128 here), sm80's elsewhere (64)."""
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device="cuda")
    assert_planned(LENGTHS_Q, LENGTHS_K, head_dim=d, is_causal=True, softcap=softcap, sinks=sinks)
    check_varlen(LENGTHS_Q, LENGTHS_K, is_causal=True, softcap=softcap, sinks=sinks, dtype=torch.float16, d=d,
                 d_v=d_v, device="cuda", seed=2)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
def test_varlen_forward_many_short_sequences_and_one_long(family, d):
    """The mix the longest-first order is for: 96 short sequences and one of 2K (sm90 at d=128:
    persistent blocks taking items from the work list)."""
    lengths = [2048] + [17, 64, 100, 250] * 24
    with fusedattn.backends.force(family):
        assert_planned(lengths, lengths, head_dim=d, is_causal=True)
        check_varlen(lengths, lengths, is_causal=True, dtype=torch.bfloat16, hq=2, hkv=1, d=d, device="cuda", seed=3)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("d", [64, 128, 96], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("is_causal,window", [(False, None), (True, None), (False, (40, 3))],
                         ids=["full", "causal", "window"])
def test_varlen_backward_matches_reference(family, d, is_causal, window):
    with fusedattn.backends.force(family):
        assert_planned(LENGTHS_Q, LENGTHS_K, backward=True, head_dim=d, is_causal=is_causal, window=window)
        check_varlen_backward(LENGTHS_Q, LENGTHS_K, is_causal=is_causal, window=window, dtype=torch.float16, d=d,
                              hq=4, hkv=2, device="cuda", seed=d)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("softcap", [None, 2.5], ids=["sinks", "softcap-sinks"])
def test_varlen_backward_sinks_softcap_and_mqa(family, d, softcap):
    sinks = torch.tensor([0.3, -0.7, 1.1, 0.0, 2.0, -2.0])
    with fusedattn.backends.force(family):
        assert_planned(LENGTHS_Q, LENGTHS_K, backward=True, head_dim=d, is_causal=True, softcap=softcap)
        check_varlen_backward(LENGTHS_Q, LENGTHS_K, is_causal=True, sinks=sinks, softcap=softcap,
                              dtype=torch.bfloat16, d=d, hq=6, hkv=1, device="cuda", seed=4)


@pytest.mark.parametrize("family", FAMILIES)
def test_varlen_backward_many_short_sequences_and_one_long(family):
    lengths = [2048] + [17, 64, 100, 250] * 24
    with fusedattn.backends.force(family):
        assert_planned(lengths, lengths, backward=True, head_dim=128, is_causal=True)
        check_varlen_backward(lengths, lengths, is_causal=True, dtype=torch.bfloat16, hq=2, hkv=1, d=128,
                              device="cuda", seed=6)


def test_varlen_backward_deterministic_is_bitwise_repeatable():
    """torch.use_deterministic_algorithms: grad_q from the dQ pass's own work list, the same bits twice."""
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, d=64, dtype=torch.float16, device="cuda", requires_grad=True)
    torch.use_deterministic_algorithms(True)
    try:
        plan = fusedattn.plan_varlen(q, k, v, cu_q, cu_k, is_causal=True, backward=True)
        assert plan["deterministic"] and plan["family"] == "sm80"
        runs = []
        for _ in range(2):
            out = fusedattn.attention_varlen(q, k, v, cu_q, cu_k, is_causal=True)
            runs.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
        for a, b in zip(*runs):
            assert torch.equal(a, b)
        check_varlen_backward(LENGTHS_Q, LENGTHS_K, is_causal=True, dtype=torch.float16, d=64, device="cuda", seed=5)
    finally:
        torch.use_deterministic_algorithms(False)


def test_varlen_opcheck_and_compile_on_cuda():
    q, k, v, cu_q, cu_k = packed([40, 0, 90], [60, 30, 90], d=64, dtype=torch.bfloat16, device="cuda",
                                 requires_grad=True)
    torch.library.opcheck(torch.ops.fusedattn.forward_varlen.default, (q, k, v, cu_q, cu_k, 90, 90, True))
    q0, k0, v0 = (t.detach() for t in (q, k, v))
    out, lse = torch.ops.fusedattn.forward_varlen(q0, k0, v0, cu_q, cu_k, 90, 90, True)
    torch.library.opcheck(torch.ops.fusedattn.backward_varlen.default,
                          (torch.randn_like(out), q0, k0, v0, out, lse, cu_q, cu_k, 90, 90, True))
    torch._dynamo.reset()
    compiled = torch.compile(fusedattn.attention_varlen, fullgraph=True)
    out = compiled(q, k, v, cu_q, cu_k, 90, 90, True)
    torch.testing.assert_close(out, fusedattn.attention_varlen(q, k, v, cu_q, cu_k, 90, 90, True), atol=0, rtol=0)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.skipif(not sm90_available(), reason="needs the sm90 family (Hopper)")
def test_varlen_forced_sm90_says_why_not():
    q, k, v, cu_q, cu_k = packed([10, 20], [10, 20], d=32, dtype=torch.float16, device="cuda")
    with fusedattn.backends.force("sm90"), pytest.raises(RuntimeError, match="the sm90 forward has head dims"):
        fusedattn.attention_varlen(q, k, v, cu_q, cu_k)


def test_varlen_cuda_refusals_name_the_limit():
    q, k, v, cu_q, cu_k = packed([10, 20], [10, 20], d=64, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be on q's device"):
        fusedattn.attention_varlen(q, k, v, cu_q.cpu(), cu_k)
    with pytest.raises(RuntimeError, match="cu_seqlens_k must not decrease"):
        fusedattn.attention_varlen(q, k, v, cu_q, torch.tensor([0, 25, 20], dtype=torch.int32, device="cuda"))
    # Past the kernels' head dims: the gemm family (tests/test_gemm_family.py); soft-capped calls stay on the kernels.
    big = max(cuda_head_dims("sm80_forward")) + 8
    q, k, v, cu_q, cu_k = packed([10], [10], d=big, dtype=torch.float16, device="cuda")
    assert fusedattn.plan_varlen(q, k, v, cu_q, cu_k)["family"] == "gemm"
    q, k, v, cu_q, cu_k = packed([10], [10], d=64, dtype=torch.float16, device="cuda")
    assert fusedattn.plan_varlen(q, k, v, cu_q, cu_k, softcap=3.0)["family"] in ("sm80", "sm90")
    assert fusedattn.plan_varlen(q, k, v, cu_q, cu_k, softcap=3.0, backward=True)["family"] in ("sm80", "sm90")


# Packed queries against KV caches: a prefill from empty, decodes, a chunk onto a long cache,
# a sequence without new queries, one filling its cache.
KV_N_Q = [300, 1, 1, 130, 0, 1, 64, 1]
KV_CACHED = [0, 700, 3, 500, 12, 0, 959, 1023]


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128, 192], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
def test_packed_kvcache_matches_reference_and_appends(dtype, d, is_causal):
    """forward_kvcache with cu_seqlens_q runs sm80's varlen forward over the caches' rows (at
    every head dim of sm80's forward: 192 loads its rows' 24 chunks dealt over 128 threads)."""
    q, k_cache, v_cache, lens, cu, k_new, v_new = packed_cache(KV_N_Q, KV_CACHED, d=d, max_len=1024, dtype=dtype,
                                                               device="cuda")
    plan = fusedattn.plan_kvcache(q, k_cache, v_cache, lens, k_new, v_new, is_causal=is_causal, cu_seqlens_q=cu)
    assert (plan["family"], plan["varlen"], plan["schedule"]) == ("sm80", True, "longest-first"), plan
    assert plan["work_items"] == tiles(KV_N_Q, plan["block_m"]), plan
    check_packed_kvcache(KV_N_Q, KV_CACHED, is_causal=is_causal, d=d, max_len=1024, dtype=dtype, device="cuda")


def test_packed_kvcache_gqa_window_sinks_and_no_new_keys():
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -0.5], device="cuda")
    check_packed_kvcache(KV_N_Q, KV_CACHED, window=(100, 0), sinks=sinks, Hq=6, Hkv=2, d=64, max_len=1024,
                         dtype=torch.bfloat16, device="cuda", seed=3)
    check_packed_kvcache([5, 1, 40], [100, 1, 0], appends=False, Hq=4, Hkv=1, d=128, max_len=256,
                         dtype=torch.float16, device="cuda", seed=4)


def test_packed_kvcache_refusals():
    # A head dim the kernels are not built for (they read the caches in place): the gemm family.
    q, k_cache, v_cache, lens, cu, k_new, v_new = packed_cache([3, 1], [4, 9], d=40, max_len=16, dtype=torch.float16,
                                                               device="cuda")
    assert fusedattn.plan_kvcache(q, k_cache, v_cache, lens, k_new, v_new, cu_seqlens_q=cu)["family"] == "gemm"
    q, k_cache, v_cache, lens, cu, k_new, v_new = packed_cache([3, 1], [4, 9], d=64, max_len=16, dtype=torch.float16,
                                                               device="cuda")
    before, before_v = k_cache.clone(), v_cache.clone()
    v_strided = torch.randn(2, 2, 32, 64, device="cuda", dtype=torch.float16)[:, :, :16]  # its batch stride is K's x 2
    with pytest.raises(RuntimeError, match="batch strides that are the same multiple"):
        fusedattn.attention_with_kvcache(q, k_cache, v_strided, lens, k_new, v_new, cu_seqlens_q=cu)
    with pytest.raises(RuntimeError, match="packed queries \\(cu_seqlens_q\\) run the varlen forward, pass None"):
        fusedattn.attention_with_kvcache(q, k_cache, v_cache, lens, k_new, v_new, num_splits=2, cu_seqlens_q=cu)
    assert torch.equal(k_cache, before) and torch.equal(v_cache, before_v)
