"""forward_kvcache with cu_seqlens_q: packed queries of many lengths (prefill chunks beside
single-token decodes) against KV caches at their own lengths, on the CPU, against the float64
reference sequence by sequence (CUDA in test_varlen_cuda.py)."""

import pytest
import torch

import fusedattn
from helpers.kvcache_cases import check_packed_kvcache, packed_cache

# A prefill from empty, decodes, a chunk onto a long cache, a sequence with no new query, one filling its cache.
N_Q = [9, 1, 1, 17, 0, 1, 5]
CACHED = [0, 40, 3, 30, 12, 0, 59]


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (6, 1)], ids=["gqa", "mha", "mqa"])
def test_packed_queries_append_and_match_the_reference(is_causal, dtype, heads):
    check_packed_kvcache(N_Q, CACHED, is_causal=is_causal, dtype=dtype, Hq=heads[0], Hkv=heads[1])


def test_packed_queries_without_new_keys_windows_softcap_and_sinks():
    """Without k_new the queries see the cached positions alone (L_b = cache_seqlens[b])."""
    check_packed_kvcache([3, 1, 4], [10, 1, 20], appends=False)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    check_packed_kvcache(N_Q, CACHED, window=(6, 0), softcap=3.0, sinks=sinks, seed=2)


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
