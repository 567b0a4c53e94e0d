"""Sliding windows (window=(left, right), bottom-right aligned as is_causal) on
every backend, forward, backward and decoding, against the float64 reference;
on CUDA the banded kernels, which visit only the key tiles a window reaches
(decoding with a window on CUDA: test_kvcache.py)."""

import re

import numpy as np
import pytest
import torch
from hypothesis import given

import fusedattn
from fusedattn import reference
from helpers.attention_cases import MASK_KINDS, Case, cases, check_backward, check_forward, make_inputs
from helpers.cuda import check_cuda, check_cuda_backward, sm90_available
from helpers.kvcache_cases import make_cache

WINDOWS = [(-1, -1), (0, 0), (3, 0), (0, 5), (16, 16), (-1, 0), (100, -1), (-1, 40), (2000, 2000)]
SIZES = [(113, 97), (97, 300), (300, 97), (1, 300), (257, 257)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("nq,nk", SIZES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_window_forms(backend, window, nq, nk, is_causal):
    """Left only, right only, both, 0, wider than N, with and without
    is_causal; Nq > Nk leaves the first rows with nothing to see."""
    backend.check_forward(Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=nq, seqlen_k=nk, head_dim=64,
                               dtype=backend.primary_dtype, is_causal=is_causal, window=window))


@pytest.mark.parametrize("mask", MASK_KINDS)
@pytest.mark.parametrize("window", [(5, 0), (30, 30), (-1, 0)], ids=str)
def test_window_with_masks(backend, mask, window):
    backend.check_forward(Case(seqlen_q=113, seqlen_k=800, head_dim=64, dtype=backend.primary_dtype, mask=mask,
                               window=window))


@pytest.mark.parametrize("window", [(7, 0), (40, 3), (0, 0)], ids=str)
@pytest.mark.parametrize("heads", [(8, 1), (6, 2)], ids=["mqa", "gqa"])
def test_window_grouped_query_heads(backend, window, heads):
    backend.check_forward(Case(heads_q=heads[0], heads_kv=heads[1], seqlen_q=300, seqlen_k=520, head_dim=64,
                               dtype=backend.primary_dtype, window=window))


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("nq,nk", [(113, 97), (97, 300), (300, 97), (1, 300)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_window_backward(backend, window, nq, nk, is_causal):
    """Gradients, rows that see nothing (zero dq) and keys no query sees (zero dk, dv) included."""
    backend.check_backward(Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=nq, seqlen_k=nk, head_dim=64,
                                dtype=backend.primary_dtype, is_causal=is_causal, window=window))


@pytest.mark.parametrize("mask", ["key_padding", "bool", "fully_masked_rows"])
def test_window_backward_with_masks_and_groups(backend, mask):
    backend.check_backward(Case(heads_q=6, heads_kv=2, seqlen_q=150, seqlen_k=260, head_dim=64,
                                dtype=backend.primary_dtype, mask=mask, window=(20, 10)))


@given(cases(max_len=300, with_windows=True))
def test_window_random_cases_cpu(case):
    check_forward(case)


@given(cases(max_len=200, with_windows=True))
def test_window_random_cases_cpu_backward(case):
    check_backward(case)


def test_window_equals_the_banded_mask():
    """A window is the bool mask of its band: same bits on the CPU."""
    q, k, v, _ = make_inputs(Case(seqlen_q=200, seqlen_k=333))
    band = reference.window_mask(200, 333, (17, 4))
    out_w = fusedattn.attention(q, k, v, window=(17, 4))
    out_m = fusedattn.attention(q, k, v, band)
    torch.testing.assert_close(out_w, out_m, atol=1e-6, rtol=0)


def test_causal_folds_into_the_window():
    """(-1, 0) is is_causal, and is_causal with any right side is is_causal."""
    q, k, v, _ = make_inputs(Case(seqlen_q=100, seqlen_k=130))
    causal = fusedattn.attention(q, k, v, is_causal=True)
    for window, is_causal in (((-1, 0), False), ((-1, 9), True), ((-1, -1), True)):
        torch.testing.assert_close(fusedattn.attention(q, k, v, is_causal=is_causal, window=window), causal,
                                   atol=0, rtol=0)


@pytest.mark.parametrize("window", [(3, 0), (0, 0), (-1, 0), (50, -1)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_window_kvcache(window, dtype):
    """Decoding with a window: each sequence's queries against its own L_b positions."""
    q, k_cache, v_cache, lens, k_new, v_new = make_cache(nq=2, n_new=2, dtype=dtype, seed=3)
    out, lse = torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, lens, k_new, v_new, True, None,
                                                   window=list(window))
    for b in range(q.shape[0]):
        end = int(lens[b]) + 2
        k, v = k_cache[b:b + 1, :, :end], v_cache[b:b + 1, :, :end]
        ref, ref_lse = reference.attention_with_lse(q[b:b + 1].double(), k.double(), v.double(), None, True, None,
                                                    window)
        torch.testing.assert_close(out[b:b + 1].double(), ref, atol=2e-5 if dtype == torch.float32 else 2e-2,
                                   rtol=0)
        hidden = ref_lse == float("-inf")
        assert torch.equal(lse[b:b + 1] == float("-inf"), hidden)
    wrapped = fusedattn.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), lens, k_new, v_new, window=window)
    torch.testing.assert_close(wrapped, out, atol=0, rtol=0)


@pytest.mark.parametrize("window,given", [([1], r"\[1\]"), ([1, 2, 3], r"\[1, 2, 3\]"), ([-2, 0], r"\[-2, 0\]"),
                                          ([0, -5], r"\[0, -5\]")])
def test_bad_windows_are_refused(window, given):
    q, k, v, _ = make_inputs(Case())
    pattern = r"window must be two ints \[left, right\], each >= -1 .*got " + given
    with pytest.raises(RuntimeError, match=pattern):
        torch.ops.fusedattn.forward(q, k, v, window=window)
    with pytest.raises(RuntimeError, match=pattern):
        fusedattn.plan(q, k, v, window=window)
    q, k_cache, v_cache, lens, _, _ = make_cache()
    with pytest.raises(RuntimeError, match=pattern):
        torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, lens, window=window)


@pytest.mark.parametrize("window", [(1.5, 2), ("a", 1), 3, (True, 1), (0, 2**70), (1, None)], ids=str)
def test_windows_the_schema_would_refuse_unnamed_are_refused_with_their_value(window):
    """A float, a bool, a lone number or an int past int64 reaches no operator: the Python
    functions refuse it naming the value (the schema's own error would not)."""
    q, k, v, _ = make_inputs(Case())
    q_c, k_cache, v_cache, lens, _, _ = make_cache()
    pattern = r"window must be two ints \[left, right\], each >= -1 .*got " + re.escape(repr(window))
    calls = {"attention": lambda: fusedattn.attention(q, k, v, window=window),
             "plan": lambda: fusedattn.plan(q, k, v, window=window),
             "attention_with_kvcache": lambda: fusedattn.attention_with_kvcache(q_c, k_cache, v_cache, lens,
                                                                               window=window),
             "plan_kvcache": lambda: fusedattn.plan_kvcache(q_c, k_cache, v_cache, lens, window=window)}
    for api, call in calls.items():
        with pytest.raises(RuntimeError, match=f"fusedattn.{api}: " + pattern):
            call()


def test_windows_as_lists_and_numpy_ints_are_taken():
    q, k, v, _ = make_inputs(Case(seqlen_q=40, seqlen_k=40))
    expected = fusedattn.attention(q, k, v, window=(5, 0))
    for window in ([5, 0], (np.int64(5), np.int32(0)), np.array([5, 0]), range(5, -1, -5), (torch.tensor(5), 0)):
        torch.testing.assert_close(fusedattn.attention(q, k, v, window=window), expected, atol=0, rtol=0)


def test_huge_windows_bound_nothing():
    """A side far wider than the sequences is no bound (position arithmetic must not overflow)."""
    q, k, v, _ = make_inputs(Case(seqlen_q=70, seqlen_k=50))
    full = torch.ops.fusedattn.forward(q, k, v)
    big = 2**63 - 1
    for window in ([big, big], [-1, big], [big, -1]):
        out = torch.ops.fusedattn.forward(q, k, v, window=window)
        for a, b in zip(out, full):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    check_backward(Case(seqlen_q=70, seqlen_k=50, window=(big, 3)))
    check_backward(Case(seqlen_q=70, seqlen_k=50, window=(big, 0)))


def test_bad_window_leaves_the_cache_untouched():
    q, k_cache, v_cache, lens, k_new, v_new = make_cache(nq=2, n_new=2, seed=5)
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(RuntimeError, match="window must be two ints"):
        torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, lens, k_new, v_new, window=[1, 2, 3])
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_window_opcheck_and_compile():
    case = Case(seqlen_q=70, seqlen_k=90, mask="bool", window=(9, 2))
    q, k, v, mask = make_inputs(case)
    torch.library.opcheck(torch.ops.fusedattn.forward.default, (q, k, v, mask, False, None, None, [9, 2]))
    out, lse = torch.ops.fusedattn.forward(q, k, v, mask, False, None, window=[9, 2])
    torch.library.opcheck(torch.ops.fusedattn.backward.default,
                          (torch.randn_like(out), q, k, v, out, lse, mask, False, None, None, [9, 2]))
    torch._dynamo.reset()
    q.requires_grad_()
    f = torch.compile(lambda q, k, v: fusedattn.attention(q, k, v, window=(9, 2)).sum(), fullgraph=True,
                      dynamic=True)
    f(q, k, v).backward()
    expected = q.grad.clone()
    q.grad = None
    fusedattn.attention(q, k, v, window=(9, 2)).sum().backward()
    torch.testing.assert_close(q.grad, expected, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("n,window", [(4096, (1024, 0)), (2048, (200, 300)), (3000, (0, -1)), (1500, (-1, 70))],
                         ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_long_windows(cuda_family, n, window, head_dim):
    """Windows far narrower than N, where most key tiles are skipped and the band's
    edges cross tiles, forward and backward, on each CUDA family (the plan asserted)."""
    case = Case(batch=1, heads_q=4, heads_kv=2, seqlen_q=n, seqlen_k=n, head_dim=head_dim, dtype=torch.bfloat16,
                window=window)
    check_cuda(case)
    check_cuda_backward(case)


@pytest.mark.gpu
def test_cuda_window_plan():
    """A window runs the banded kernels' short tiles on sm90 (its items span the window, not Nk)."""
    q, k, v, _ = make_inputs(Case(seqlen_q=20000, seqlen_k=20000, head_dim=128, dtype=torch.bfloat16, batch=1,
                                  heads_q=1, heads_kv=1), "cuda")
    if not sm90_available():
        pytest.skip("this build or GPU has no sm90 kernels")
    causal, windowed = fusedattn.plan(q, k, v, is_causal=True), fusedattn.plan(q, k, v, window=(1024, 0))
    assert (causal["family"], causal["block_n"]) == ("sm90", 176), causal
    assert (windowed["family"], windowed["block_n"], windowed["persistent"]) == ("sm90", 128, True), windowed
