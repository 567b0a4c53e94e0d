"""forward_kvcache with cu_seqlens_q: packed queries of many lengths (prefill chunks beside
single-token decodes) against KV caches at their own lengths, on the CPU and on CUDA (sm80's
varlen forward over the caches' rows), against the float64 reference sequence by sequence."""

import pytest
import torch

import fusedattn
from helpers.kvcache_cases import check_packed_kvcache, packed_cache
from helpers.varlen_cases import tiles

# A prefill from empty, decodes, a chunk onto a long cache, a sequence with no new query, one filling its cache:
# (queries, cached positions, cache length) per device (on CUDA, several query tiles).
CASES = {"cpu": ([9, 1, 1, 17, 0, 1, 5], [0, 40, 3, 30, 12, 0, 59], 64),
         "cuda": ([300, 1, 1, 130, 0, 1, 64, 1], [0, 700, 3, 500, 12, 0, 959, 1023], 1024)}
N_Q, CACHED, _ = CASES["cpu"]
DTYPES = {"cpu": [torch.float32, torch.float16, torch.bfloat16], "cuda": [torch.float16, torch.bfloat16]}


def check_plan(device, n_q, cached, max_len, d, is_causal=True):
    """The plan of the packed call: the CPU kernel, or sm80's varlen forward with one work item per
    query tile, longest first."""
    q, k_cache, v_cache, lens, cu, k_new, v_new = packed_cache(n_q, cached, d=d, max_len=max_len,
                                                               dtype=DTYPES[device][-1], device=device)
    plan = fusedattn.plan_kvcache(q, k_cache, v_cache, lens, k_new, v_new, is_causal=is_causal, cu_seqlens_q=cu)
    if device == "cpu":
        assert (plan["family"], plan["varlen"]) == ("cpu", True), plan
    else:
        assert (plan["family"], plan["varlen"], plan["schedule"]) == ("sm80", True, "longest-first"), plan
        assert plan["work_items"] == tiles(n_q, plan["block_m"]), plan


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [64, 128, 192], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (6, 1)], ids=["gqa", "mha", "mqa"])
def test_packed_queries_append_and_match_the_reference(device, is_causal, dtype, d, heads):
    """On CUDA at every head dim of sm80's forward (192 loads its rows' 24 chunks dealt over 128 threads)."""
    if dtype not in DTYPES[device]:
        pytest.skip(f"{device} takes {[str(t)[6:] for t in DTYPES[device]]}, not {str(dtype)[6:]}")
    n_q, cached, max_len = CASES[device]
    check_plan(device, n_q, cached, max_len, d, is_causal)
    check_packed_kvcache(n_q, cached, is_causal=is_causal, dtype=dtype, Hq=heads[0], Hkv=heads[1], d=d,
                         max_len=max_len, device=device, seed=d)


def test_packed_queries_without_new_keys_windows_softcap_and_sinks(device):
    """Without k_new the queries see the cached positions alone (L_b = cache_seqlens[b])."""
    n_q, cached, max_len = CASES[device]
    check_packed_kvcache([5, 1, 40], [100, 1, 0], appends=False, Hq=4, Hkv=1, d=128, max_len=256,
                         dtype=DTYPES[device][0], device=device, seed=4)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -0.5], device=device)
    # float32 and soft-capped on the CPU; bfloat16 on CUDA.
    cpu = device == "cpu"
    check_packed_kvcache(n_q, cached, window=(6, 0) if cpu else (100, 0), softcap=3.0 if cpu else None, sinks=sinks,
                         Hq=6, Hkv=2, d=64, max_len=max_len, dtype=torch.float32 if cpu else torch.bfloat16,
                         device=device, seed=3)


def test_packed_queries_through_the_python_wrapper_and_plan():
    q, k_cache, v_cache, lens, cu, k_new, v_new = packed_cache(N_Q, CACHED)
    expected = check_packed_kvcache(N_Q, CACHED)  # the same inputs (seed 0): the op's result
    out = fusedattn.attention_with_kvcache(q, k_cache, v_cache, lens, k_new, v_new, cu_seqlens_q=cu)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    plan = fusedattn.plan_kvcache(q, k_cache, v_cache, lens, k_new, v_new, cu_seqlens_q=cu)
    assert (plan["family"], plan["varlen"]) == ("cpu", True), plan
    with pytest.raises(ValueError, match="packed queries \\(cu_seqlens_q\\) need cache_seqlens"):
        fusedattn.plan_kvcache(q, k_cache, v_cache, cu_seqlens_q=cu)


def test_packed_queries_opcheck_and_compile():
    q, k_cache, v_cache, lens, cu, k_new, v_new = packed_cache([3, 0, 2], [5, 2, 0])
    torch.library.opcheck(torch.ops.fusedattn.forward_kvcache.default,
                          (q, k_cache.clone(), v_cache.clone(), lens, k_new, v_new, True, None, None, None, None,
                           None, None, None, cu))
    torch._dynamo.reset()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = fusedattn.attention_with_kvcache(q, k_ref, v_ref, lens, k_new, v_new, cu_seqlens_q=cu)
    compiled = torch.compile(fusedattn.attention_with_kvcache, fullgraph=True)
    k_c, v_c = k_cache.clone(), v_cache.clone()
    torch.testing.assert_close(compiled(q, k_c, v_c, lens, k_new, v_new, cu_seqlens_q=cu), expected, atol=0, rtol=0)
    assert torch.equal(k_c, k_ref) and torch.equal(v_c, v_ref)  # the in-place append survives compilation


def test_packed_queries_bad_input_says_what_was_expected_and_leaves_the_caches():
    q, k_cache, v_cache, lens, cu, k_new, v_new = packed_cache(N_Q, CACHED)
    before = (k_cache.clone(), v_cache.clone())
    op = torch.ops.fusedattn.forward_kvcache

    def call(q=q, lens=lens, cu=cu, k_new=k_new, v_new=v_new, num_splits=None):
        return op(q, k_cache, v_cache, lens, k_new, v_new, True, None, num_splits, None, None, None, None, None, cu)

    with pytest.raises(RuntimeError, match="sequence 6 has 60 cached positions and 5 new ones, but the cache holds 64"):
        call(lens=lens + torch.tensor([0, 0, 0, 0, 0, 0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"with cu_seqlens_q, q must be \[total_q, Hq, d\]"):
        call(q=q.unsqueeze(0))
    with pytest.raises(RuntimeError, match="cu_seqlens_q must end at the 34 rows of q, got 33"):
        call(cu=torch.tensor([0, 9, 10, 11, 28, 28, 29, 33], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="the caches hold 7 sequences but the call has 6"):
        call(cu=cu[1:] - 9, q=q[9:], k_new=k_new[9:], v_new=v_new[9:])
    with pytest.raises(RuntimeError, match=r"k_new must be \[total_q, Hkv, d\] = \[34, 2, 32\]"):
        call(k_new=k_new[:5], v_new=v_new[:5])
    with pytest.raises(RuntimeError, match="cache_seqlens must be int32"):
        call(lens=lens.long())
    with pytest.raises(RuntimeError, match="cu_seqlens_q must not decrease"):
        call(cu=torch.tensor([0, 9, 8, 11, 28, 28, 29, 34], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="merge_in_cluster and warps choose CUDA decode blocks"):
        op(q, k_cache, v_cache, lens, k_new, v_new, True, None, None, True, None, None, None, None, cu)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.gpu
def test_packed_queries_cuda_refusals():
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
