"""forward_kvcache: decoding against a preallocated KV cache, on the CPU."""

import pytest
import torch

import fusedattn
from fusedattn import reference
from helpers.kvcache_cases import check_against_reference, make_cache


@pytest.mark.parametrize("nq", [1, 2, 7])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_causal", [True, False])
def test_matches_reference_and_appends(nq, heads, dtype, is_causal):
    q, k_cache, v_cache, lens, k_new, v_new = make_cache(Hq=heads[0], Hkv=heads[1], nq=nq, n_new=nq,
                                                         dtype=dtype, seed=nq)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, lens, k_new, v_new, is_causal, None)
    for b in range(q.shape[0]):
        start, end = int(lens[b]), int(lens[b]) + nq
        assert torch.equal(k_cache[b, :, start:end], k_new[b]) and torch.equal(v_cache[b, :, start:end], v_new[b])
        for cache, before in ((k_cache, k_before), (v_cache, v_before)):  # nothing else written
            assert torch.equal(cache[b, :, :start], before[b, :, :start])
            assert torch.equal(cache[b, :, end:], before[b, :, end:])
    check_against_reference(q, k_cache, v_cache, lens, k_new, v_new, is_causal, out, lse)


@pytest.mark.parametrize("head_dim", [1, 64, 128, 200])
def test_without_new_keys_and_head_dims(head_dim):
    q, k_cache, v_cache, lens, _, _ = make_cache(d=head_dim, nq=3, n_new=0, seed=head_dim)
    before = k_cache.clone()
    out, lse = torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, lens, None, None, True, 0.3)
    assert torch.equal(k_cache, before)
    for b in range(q.shape[0]):
        end = int(lens[b])
        ref = reference.attention(q[b:b + 1].double(), k_cache[b:b + 1, :, :end].double(),
                                  v_cache[b:b + 1, :, :end].double(), is_causal=True, scale=0.3)
        torch.testing.assert_close(out[b:b + 1].double(), ref, atol=2e-5, rtol=0)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()  # empty cache: nothing to see


def test_python_wrapper_and_decode_loop():
    """Token-by-token decoding equals one causal pass over the whole sequence."""
    torch.manual_seed(0)
    B, H, d, n = 2, 4, 16, 40
    q, k, v = (torch.randn(B, H, n, d) for _ in range(3))
    full = fusedattn.attention(q, k, v, is_causal=True)
    k_cache, v_cache = torch.zeros(B, H, n, d), torch.zeros(B, H, n, d)
    lens = torch.zeros(B, dtype=torch.int32)
    for t in range(n):
        step = fusedattn.attention_with_kvcache(q[:, :, t:t + 1], k_cache, v_cache, lens,
                                                k[:, :, t:t + 1], v[:, :, t:t + 1])
        torch.testing.assert_close(step, full[:, :, t:t + 1], atol=1e-6, rtol=1e-6)
        lens += 1


def test_opcheck_and_compile():
    q, k_cache, v_cache, lens, k_new, v_new = make_cache(nq=2, n_new=2)
    torch.library.opcheck(torch.ops.fusedattn.forward_kvcache.default,
                          (q, k_cache.clone(), v_cache.clone(), lens, k_new, v_new, True, None))
    torch._dynamo.reset()
    expected_cache = k_cache.clone()
    expected, _ = torch.ops.fusedattn.forward_kvcache(q, expected_cache, v_cache.clone(), lens, k_new, v_new)
    compiled = torch.compile(fusedattn.attention_with_kvcache, fullgraph=True)
    k_c, v_c = k_cache.clone(), v_cache.clone()
    torch.testing.assert_close(compiled(q, k_c, v_c, lens, k_new, v_new), expected, atol=0, rtol=0)
    assert torch.equal(k_c, expected_cache)  # the in-place append survives compilation


def test_bad_inputs():
    q, k_cache, v_cache, lens, k_new, v_new = make_cache(max_len=10, n_new=2)
    op = torch.ops.fusedattn.forward_kvcache
    with pytest.raises(RuntimeError, match="sequence 0 has 9 cached positions and 2 new ones, but the cache holds 10"):
        op(q, k_cache, v_cache, torch.full((3,), 9, dtype=torch.int32), k_new, v_new)
    with pytest.raises(RuntimeError, match="cache_seqlens must be int32"):
        op(q, k_cache, v_cache, lens.long(), k_new, v_new)
    with pytest.raises(RuntimeError, match="k_new and v_new must be given together"):
        op(q, k_cache, v_cache, lens, k_new, None)
    with pytest.raises(RuntimeError, match=r"k_new must be \[B, Hkv, Nnew, d\] = \[3, 2, Nnew, 32\] and v_new"):
        op(q, k_cache, v_cache, lens, k_new[..., :5], v_new[..., :5])
    with pytest.raises(RuntimeError, match=r"v_new \[B, Hkv, Nnew, d_v\] with d_v = 32, got .* and \[3, 2, 2, 5\]"):
        op(q, k_cache, v_cache, lens, k_new, v_new[..., :5])
    with pytest.raises(RuntimeError, match="the caches hold 3 sequences but the call has 2"):
        op(q[:2], k_cache, v_cache, lens, k_new, v_new)


def test_rejected_calls_leave_the_cache_untouched():
    q, k_cache, v_cache, lens, k_new, v_new = make_cache(n_new=2)
    before = k_cache.clone()
    op = torch.ops.fusedattn.forward_kvcache
    with pytest.raises(RuntimeError, match="need the same d"):
        op(torch.randn(3, 4, 1, 33), k_cache, v_cache, lens, k_new, v_new)
    with pytest.raises(RuntimeError, match="must share dtype and device"):
        op(q.double(), k_cache, v_cache, lens, k_new, v_new)
    with pytest.raises(RuntimeError, match="k_new and v_new must have the caches' dtype"):
        op(q, k_cache, v_cache, lens, k_new.double(), v_new.double())
    with pytest.raises(RuntimeError, match="must be different tensors"):
        op(q, k_cache, k_cache, lens, k_new, v_new)
    assert torch.equal(k_cache, before)


def test_narrowed_cache_view():
    """A view of the positions in use (docs/semantics.md's advice for caches far
    longer than their lengths) answers as the whole cache does and appends
    into it."""
    q, k_cache, v_cache, _, k_new, v_new = make_cache(max_len=300)
    lens = torch.tensor([0, 17, 40], dtype=torch.int32)
    k_whole, v_whole = k_cache.clone(), v_cache.clone()
    expected = torch.ops.fusedattn.forward_kvcache(q, k_whole, v_whole, lens, k_new, v_new, True, None)
    got = torch.ops.fusedattn.forward_kvcache(q, k_cache[:, :, :48], v_cache[:, :, :48], lens, k_new, v_new,
                                              True, None)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    assert torch.equal(k_cache, k_whole) and torch.equal(v_cache, v_whole)


def test_non_contiguous_cache_seqlens():
    q, k_cache, v_cache, lens, k_new, v_new = make_cache(n_new=1)
    spread = torch.stack([lens, torch.zeros_like(lens)], dim=1).flatten()[::2]  # stride 2
    assert not spread.is_contiguous() and torch.equal(spread, lens)
    expected, _ = torch.ops.fusedattn.forward_kvcache(q, k_cache.clone(), v_cache.clone(), lens, k_new, v_new)
    out, _ = torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, spread, k_new, v_new)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
