"""forward_kvcache: decoding against a preallocated KV cache, on the CPU
kernel and on CUDA's split-KV decode kernels (marker `gpu`), against the
float64 reference. The tests of what both take run on each device; a CUDA
test that means to cover a path (a split count, the cluster or the global
merge, 4 or 8 warps) asserts that the plan of its call says that path."""

import re

import pytest
import torch

import fusedattn
from fusedattn import reference
from fusedattn.ops import cuda_head_dims
from helpers.cuda import GPU_DTYPES, at_odd_offset, poison_allocator
from helpers.kvcache_cases import check_against_reference, make_cache, on_device

op = torch.ops.fusedattn.forward_kvcache
CPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# Both ways the splits of a row tile merge: in a thread block cluster (True:
# required, so the call raises if it cannot; sm_90, 2-8 splits, every cluster
# of the grid at once, as in these tests' small grids), or through global
# memory (False: the last split to arrive merges).
merge_paths = pytest.mark.parametrize("merge", [True, False], ids=["cluster-merge", "global-merge"])

# A decode block of 8 warps at d=128 needs this much shared memory (its Q tile
# and a ring of three 128-key K and V tiles): H100 and H200 give a block that
# much, an A100 163 KB, where the planner takes 4 warps.
EIGHT_WARPS_AT_D128 = 200704


DECODE_HEAD_DIMS = list(cuda_head_dims("decode"))


def planned_warps(head_dim):
    """The planner's warps per decode block: 8 where a block holds them, else 4
    (at d=128 where the block's shared memory is short, and at d=256)."""
    if head_dim <= 64:
        return 8
    fits = head_dim == 128 and torch.cuda.get_device_properties(0).shared_memory_per_block_optin >= EIGHT_WARPS_AT_D128
    return 8 if fits else 4


def head_dims_and_warps():
    """Every head dim with the planner's warps, and d=128 with 4 and with 8
    forced (other head dims have 8 warps only)."""
    cases = [pytest.param(d, None, id=str(d)) for d in DECODE_HEAD_DIMS]
    if 128 in DECODE_HEAD_DIMS:
        cases += [pytest.param(128, w, id=f"128-{w}-warps") for w in (4, 8)]
    return cases


def skip_unless_runnable(merge=None, warps=None):
    """A forced cluster merge needs sm_90, forced 8 warps at d=128 a block
    that holds them; elsewhere the call raises (the error tests cover that)."""
    if merge and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("thread block clusters need sm_90")
    if warps == 8 and planned_warps(128) != 8:
        pytest.skip("a decode block of 8 warps at d=128 does not fit this device")


def plan_of(q, k_cache, v_cache, num_splits=None, merge_in_cluster=None, warps=None):
    """The plan of op(q, k_cache, v_cache, ..., num_splits=, merge_in_cluster=,
    warps=): plan_kvcache with the same choices (the last two through force())."""
    with fusedattn.backends.force(decode_warps=warps, decode_merge_in_cluster=merge_in_cluster):
        return fusedattn.plan_kvcache(q, k_cache, v_cache, num_splits=num_splits)


def check_plan(args, choices, **expected):
    """The plan of a call on args (q, k_cache, v_cache, ...) with `choices` says `expected`."""
    plan = plan_of(*args[:3], **choices)
    assert {key: plan[key] for key in expected} == expected, plan
    return plan


def cuda_cache(**kwargs):
    return on_device("cuda", make_cache(**kwargs))


def run_checked(q, k_cache, v_cache, lens, k_new, v_new, is_causal, window=None, **choices):
    """One call (with `choices`: num_splits, merge_in_cluster, warps), with the
    outputs poisoned (on CUDA), the append and the untouched rest of the caches checked."""
    n_new = 0 if k_new is None else k_new.shape[2]
    k_before, v_before = k_cache.clone(), v_cache.clone()
    if q.is_cuda:
        poison_allocator((q.shape, q.dtype), (q.shape[:3], torch.float32))
    out, lse = op(q, k_cache, v_cache, lens, k_new, v_new, is_causal, None, **choices,
                  window=None if window is None else list(window))
    for b in range(q.shape[0]):
        start, end = int(lens[b]), int(lens[b]) + n_new
        if n_new:
            assert torch.equal(k_cache[b, :, start:end], k_new[b])
            assert torch.equal(v_cache[b, :, start:end], v_new[b])
        for cache, before in ((k_cache, k_before), (v_cache, v_before)):
            assert torch.equal(cache[b, :, :start], before[b, :, :start])
            assert torch.equal(cache[b, :, end:], before[b, :, end:])
    check_against_reference(q, k_cache, v_cache, lens, k_new, v_new, is_causal, out, lse, window)
    return out, lse


def decode_variants():
    """(device, dtype, head_dim, warps, splits): the CPU at some head dims (it takes any); CUDA
    at each of the decode kernel's, with one split (the decode kernel writes out and lse) and
    the automatic count (about 10 splits here, merged), each with the planner's warps per block
    and, at d=128, with 4 and 8 forced (8 warps' ring fits a block on H100 and H200, not on an
    A100)."""
    cases = [pytest.param("cpu", dtype, d, None, None, id=f"cpu-{str(dtype)[6:]}-{d}")
             for dtype in CPU_DTYPES for d in (32, 128)]
    for dtype in GPU_DTYPES:
        for d, warps, name in [(d, None, str(d)) for d in DECODE_HEAD_DIMS] + (
                [(128, w, f"128-{w}-warps") for w in (4, 8)] if 128 in DECODE_HEAD_DIMS else []):
            cases += [pytest.param("cuda", dtype, d, warps, splits, marks=pytest.mark.gpu,
                                   id=f"cuda-{str(dtype)[6:]}-{name}-{label}")
                      for splits, label in ((1, "one-split"), (None, "auto-splits"))]
    return cases


@pytest.mark.parametrize("nq", [1, 2, 7])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("device,dtype,head_dim,warps,splits", decode_variants())
def test_kvcache_matches_reference_and_appends(device, dtype, head_dim, warps, splits, nq, heads, is_causal):
    # max_len 700: several 64-key tiles, lengths from 0 (empty) to full.
    args = on_device(device, make_cache(B=4, Hq=heads[0], Hkv=heads[1], d=head_dim, max_len=700, nq=nq, n_new=nq,
                                        dtype=dtype, seed=nq + head_dim))
    if device == "cpu":
        assert fusedattn.plan_kvcache(*args[:3])["family"] == "cpu"
        run_checked(*args, is_causal)
        return
    skip_unless_runnable(warps=warps)
    choices = {"num_splits": splits, "warps": warps}
    plan = check_plan(args, choices, warps=warps or planned_warps(head_dim))
    assert (plan["num_splits"] > 1) == (splits is None), plan
    run_checked(*args, is_causal, **choices)


# (dtype, head dim, tolerance) of the decoding loop per device.
LOOP = {"cpu": (torch.float32, 16, 1e-6), "cuda": (torch.float16, 64, 2e-3)}


def test_kvcache_decode_loop_equals_causal_forward(device):
    """Token-by-token decoding through the Python wrapper equals one causal pass over the whole sequence."""
    dtype, d, tol = LOOP[device]
    torch.manual_seed(0)
    B, Hq, Hkv, n = 2, 8, 2, 70
    q = torch.randn(B, Hq, n, d, dtype=dtype).to(device)
    k, v = (torch.randn(B, Hkv, n, d, dtype=dtype).to(device) for _ in range(2))
    full = fusedattn.attention(q, k, v, is_causal=True)
    k_cache, v_cache = (torch.zeros(B, Hkv, n, d, device=device, dtype=dtype) for _ in range(2))
    lens = torch.zeros(B, dtype=torch.int32, device=device)
    for t in range(n):
        step = fusedattn.attention_with_kvcache(q[:, :, t:t + 1], k_cache, v_cache, lens,
                                                k[:, :, t:t + 1], v[:, :, t:t + 1])
        torch.testing.assert_close(step, full[:, :, t:t + 1], atol=tol, rtol=tol)
        lens += 1


def test_kvcache_opcheck_and_compile(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k_cache, v_cache, lens, k_new, v_new = on_device(device, make_cache(B=2, Hq=4, Hkv=2, d=64, max_len=200, nq=2,
                                                                           n_new=2, dtype=dtype))
    # The planner's choices, then (CUDA's) num_splits, merge_in_cluster, warps.
    for choices in ((),) + (((2, False, None),) if device == "cuda" else ()):
        torch.library.opcheck(torch.ops.fusedattn.forward_kvcache.default,
                              (q, k_cache.clone(), v_cache.clone(), lens, k_new, v_new, True, None, *choices))
    torch._dynamo.reset()
    expected_k = k_cache.clone()
    expected, _ = op(q, expected_k, v_cache.clone(), lens, k_new, v_new)
    compiled = torch.compile(fusedattn.attention_with_kvcache, fullgraph=True)
    k_c, v_c = k_cache.clone(), v_cache.clone()
    torch.testing.assert_close(compiled(q, k_c, v_c, lens, k_new, v_new), expected, atol=0, rtol=0)
    assert torch.equal(k_c, expected_k)  # the in-place append survives compilation


def test_kvcache_non_contiguous_cache_seqlens(device):
    q, k_cache, v_cache, lens, k_new, v_new = on_device(device, make_cache(n_new=1, d=64, dtype=torch.float16))
    spread = torch.stack([lens, torch.zeros_like(lens)], dim=1).flatten()[::2]  # stride 2
    assert not spread.is_contiguous() and torch.equal(spread, lens)
    expected, _ = op(q, k_cache.clone(), v_cache.clone(), lens, k_new, v_new)
    out, _ = op(q, k_cache, v_cache, spread, k_new, v_new)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("head_dim", [1, 64, 128, 200])
def test_cpu_kvcache_without_new_keys_and_any_head_dim(head_dim):
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


def test_cpu_kvcache_bad_inputs():
    q, k_cache, v_cache, lens, k_new, v_new = make_cache(max_len=10, n_new=2)
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


def test_cpu_kvcache_rejected_calls_leave_the_cache_untouched():
    q, k_cache, v_cache, lens, k_new, v_new = make_cache(n_new=2)
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="need the same d"):
        op(torch.randn(3, 4, 1, 33), k_cache, v_cache, lens, k_new, v_new)
    with pytest.raises(RuntimeError, match="must share dtype and device"):
        op(q.double(), k_cache, v_cache, lens, k_new, v_new)
    with pytest.raises(RuntimeError, match="k_new and v_new must have the caches' dtype"):
        op(q, k_cache, v_cache, lens, k_new.double(), v_new.double())
    with pytest.raises(RuntimeError, match="must be different tensors"):
        op(q, k_cache, k_cache, lens, k_new, v_new)
    assert torch.equal(k_cache, before)


def test_cpu_kvcache_narrowed_cache_view():
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


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3, 64])
def test_cuda_kvcache_forced_splits(splits):
    """Every split count gives the reference's answer, also splits with no
    keys; a count above one split per 64 cache positions is cut to that (64
    to 24 here)."""
    args = cuda_cache(B=3, Hq=8, Hkv=2, d=64, max_len=1500, nq=2, n_new=2, dtype=torch.float16)
    check_plan(args, {"num_splits": splits}, num_splits=min(splits, 24))  # 24 = ceil(1500 / 64)
    run_checked(*args, True, num_splits=splits)


@pytest.mark.gpu
@merge_paths
def test_cuda_kvcache_split_merge_is_exact(merge):
    """Merging splits equals one pass up to float32 rounding. With q = 0 every
    score is 0 and every probability exactly 1, so no split rounds P
    differently (with random scores P is rounded to float16 against each
    split's own running max, a difference within the tolerance rule that the
    forced-splits test covers); v holds small integers, whose sums are exact.
    5 splits merge as forced; 32 are more than a cluster holds and merge
    globally either way; one split merges nothing (forcing the cluster merge
    there is no error)."""
    skip_unless_runnable(merge=merge)
    q, k_cache, v_cache, lens, _, _ = cuda_cache(B=3, Hq=4, Hkv=4, d=128, max_len=4096, nq=1, n_new=0,
                                                 dtype=torch.float16)
    q.zero_()
    v_cache.copy_(torch.randint(1, 9, v_cache.shape, device="cuda"))
    results = {}
    for splits in (1, 5, 32):
        choices = {"num_splits": splits, "merge_in_cluster": merge and splits <= 8}
        check_plan((q, k_cache, v_cache), choices, num_splits=splits, merge_in_cluster=merge and 1 < splits <= 8)
        results[splits] = op(q, k_cache, v_cache, lens, None, None, True, None, **choices)
    one_out, one_lse = results[1]
    for b in range(q.shape[0]):  # the mean of each sequence's values, in float64
        expected = v_cache[b, :, :lens[b]].double().mean(dim=1, keepdim=True)
        if lens[b] > 0:
            torch.testing.assert_close(one_out[b].double(), expected, atol=0, rtol=2**-10)
    for splits in (5, 32):
        out, lse = results[splits]
        torch.testing.assert_close(out, one_out, atol=0, rtol=2**-10)  # one float16 rounding apart at most
        torch.testing.assert_close(lse, one_lse, atol=0, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 3, 4, 8])
@pytest.mark.parametrize("head_dim,warps", head_dims_and_warps())
def test_cuda_kvcache_cluster_and_global_merge_agree(splits, head_dim, warps):
    """merge_in_cluster=True makes the splits of a row tile merge in a thread
    block cluster from each other's shared memory (and raises where they
    cannot); False makes the last split merge through global memory. Both
    merge the same float32 partials with the same code, so they agree bit for
    bit, and match the reference (Nq = 7 with 4 heads a group gives two row
    tiles; at 8 splits some splits have no keys), with blocks of 8 warps and
    of 4. Below sm_90 the global merge runs against the reference and the
    forced cluster merge raises."""
    skip_unless_runnable(warps=warps)
    args = cuda_cache(B=3, Hq=8, Hkv=2, d=head_dim, max_len=1500, nq=7, n_new=7, dtype=torch.float16,
                      seed=splits)
    by_path = {merge: {"num_splits": splits, "merge_in_cluster": merge, "warps": warps} for merge in (True, False)}
    check_plan(args, by_path[False], num_splits=splits, merge_in_cluster=False)
    global_out, global_lse = run_checked(*args, True, **by_path[False])
    if torch.cuda.get_device_capability() < (9, 0):
        with pytest.raises(RuntimeError, match="the decode kernel has no sm_90 code for this device"):
            op(*args, True, None, **by_path[True])
        return
    check_plan(args, by_path[True], num_splits=splits, merge_in_cluster=True)
    out, lse = op(*args, True, None, **by_path[True])  # appends the same rows at the same places again
    assert torch.equal(out, global_out) and torch.equal(lse, global_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("choices,message", [
    ({"num_splits": 0}, "num_splits must be None or in [1, 64], got 0"),
    ({"num_splits": 65}, "num_splits must be None or in [1, 64], got 65"),
    ({"num_splits": 1, "warps": 5}, "warps must be None, 4 or 8, got 5"),  # checked with one split too
    ({"warps": 4}, "fusedattn: decode blocks of 4 warps were forced, but at head dim 64 this device runs 8 only"),
    ({"num_splits": 16, "merge_in_cluster": True},
     "fusedattn: the merge in clusters was forced, but this call's splits cannot merge in clusters: "
     "it has 16 splits, a cluster holds 2-8"),
], ids=["no-splits", "65-splits", "5-warps", "4-warps-at-d64", "16-splits-in-clusters"])
def test_cuda_kvcache_choice_errors(choices, message):
    """A choice out of range, or one this call cannot take (4 warps at d=64;
    16 splits in clusters: more than a cluster holds), raises from the call
    and from its plan alike, instead of silently taking another path."""
    q, k_cache, v_cache, lens, _, _ = cuda_cache(B=2, Hq=8, Hkv=2, d=64, max_len=1500, nq=1, n_new=0,
                                                 dtype=torch.float16)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        op(q, k_cache, v_cache, lens, None, None, True, None, **choices)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        torch.ops.fusedattn.plan_kvcache(q, k_cache, v_cache, True, None, **choices)


@pytest.mark.gpu
def test_cuda_kvcache_forced_choices_this_device_cannot_run():
    """The cluster merge forced on a grid of more clusters than the GPU runs
    at once (512 here) raises: clusters are scheduled whole, and in waves they
    would be slower than the global merge, which the planner takes there.
    Below sm_90 it raises for want of clusters. 8 warps forced at d=128 raise
    where a block cannot hold them (an A100)."""
    q = torch.zeros(64, 8, 1, 64, device="cuda", dtype=torch.float16)
    cache = torch.zeros(64, 8, 1024, 64, device="cuda", dtype=torch.float16)
    lens = torch.zeros(64, dtype=torch.int32, device="cuda")
    why = (r"its grid has 512 clusters, the GPU runs \d+ at once" if torch.cuda.get_device_capability() >= (9, 0)
           else "the decode kernel has no sm_90 code for this device")
    with pytest.raises(RuntimeError, match="the merge in clusters was forced, but this call's splits cannot merge "
                                           "in clusters: " + why):
        op(q, cache, cache.clone(), lens, None, None, True, None, num_splits=4, merge_in_cluster=True)
    check_plan((q, cache, cache.clone()), {"num_splits": 4}, num_splits=4, merge_in_cluster=False)
    if planned_warps(128) == 4:
        q = torch.zeros(2, 8, 1, 128, device="cuda", dtype=torch.float16)
        cache = torch.zeros(2, 8, 256, 128, device="cuda", dtype=torch.float16)
        with pytest.raises(RuntimeError, match="decode blocks of 8 warps were forced, but at head dim 128"):
            op(q, cache, cache.clone(), lens[:2], None, None, True, None, warps=8)


@pytest.mark.gpu
def test_cuda_kvcache_force_reaches_attention_with_kvcache():
    """fusedattn.backends.force() hands its decode warps and merge path to
    attention_with_kvcache and plan_kvcache (a torch.ops call takes them as
    arguments instead): inside it the plan says them and the call equals the
    op given them, bit for bit; outside it the planner chooses again; a forced
    choice the call cannot take raises from attention_with_kvcache too."""
    q, k_cache, v_cache, lens, _, _ = cuda_cache(B=3, Hq=8, Hkv=2, d=128, max_len=1500, nq=1, n_new=0,
                                                 dtype=torch.float16)
    with fusedattn.backends.force(decode_warps=4, decode_merge_in_cluster=False):
        plan = fusedattn.plan_kvcache(q, k_cache, v_cache, lens, num_splits=3)
        out = fusedattn.attention_with_kvcache(q, k_cache, v_cache, lens, num_splits=3)
    assert (plan["warps"], plan["num_splits"], plan["merge_in_cluster"]) == (4, 3, False), plan
    expected, _ = op(q, k_cache, v_cache, lens, num_splits=3, merge_in_cluster=False, warps=4)
    assert torch.equal(out, expected)
    assert fusedattn.plan_kvcache(q, k_cache, v_cache)["warps"] == planned_warps(128)
    q, cache = (torch.zeros(1, 2, n, 64, device="cuda", dtype=torch.float16) for n in (1, 64))
    with fusedattn.backends.force(decode_warps=4), pytest.raises(RuntimeError, match="decode blocks of 4 warps"):
        fusedattn.attention_with_kvcache(q, cache, cache.clone(), torch.zeros(1, dtype=torch.int32, device="cuda"))


@pytest.mark.gpu
def test_cuda_kvcache_reads_what_the_kernel_before_wrote():
    """The decode kernel is a programmatic dependent launch: it may be
    scheduled while the kernel before it on the stream still runs, and must
    still read what that kernel wrote. Before each call a fill kernel rewrites
    the last V row; with q = 0 every key weighs the same, so out is exactly
    the mean of the V rows."""
    q, k_cache, v_cache, _, _, _ = cuda_cache(B=2, Hq=8, Hkv=8, d=128, max_len=4096, nq=1, n_new=0,
                                              dtype=torch.float16)
    q.zero_()
    v_cache.zero_()
    lens = torch.full((2,), 4096, dtype=torch.int32, device="cuda")
    outs = []
    for step in range(1, 9):
        v_cache[:, :, -1].fill_(64.0 * step)
        outs.append(op(q, k_cache, v_cache, lens, None, None, True, None)[0])
    torch.cuda.synchronize()
    for step, out in enumerate(outs, 1):
        torch.testing.assert_close(out, torch.full_like(out, step / 64), atol=0, rtol=0)


@pytest.mark.gpu
@merge_paths
def test_cuda_kvcache_back_to_back_calls_agree(merge):
    """Decode kernels one after another with no kernel between them: each may
    be scheduled while the one before ends, and, merging globally, reuses its
    arrival counters (and, through the caching allocator, its partial
    buffers). Every call gives the first one's answer bit for bit."""
    skip_unless_runnable(merge=merge)
    q, k_cache, v_cache, lens, _, _ = cuda_cache(B=3, Hq=8, Hkv=2, d=128, max_len=4096, nq=1, n_new=0,
                                                 dtype=torch.float16)
    choices = {"num_splits": 4, "merge_in_cluster": merge}
    check_plan((q, k_cache, v_cache), choices, num_splits=4, merge_in_cluster=merge)
    expected = op(q, k_cache, v_cache, lens, None, None, True, None, **choices)
    torch.cuda.synchronize()
    results = [op(q, k_cache, v_cache, lens, None, None, True, None, **choices) for _ in range(16)]
    torch.cuda.synchronize()
    for out, lse in results:
        assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[4096, 4096], [1, 8192], [0, 5000]])
def test_cuda_kvcache_long_caches(lengths):
    """The automatic split count on long caches, with per-sequence lengths (an empty one too)."""
    q, k_cache, v_cache, _, _, _ = cuda_cache(B=2, Hq=32, Hkv=8, d=128, max_len=8192, nq=1, n_new=0,
                                              dtype=torch.float16)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    run_checked(q, k_cache, v_cache, lens, None, None, True)


@pytest.mark.gpu
@pytest.mark.parametrize("window,is_causal", [((100, 0), True), ((0, 0), True), ((1000, -1), False),
                                              ((300, 2), False), ((5000, 0), True), ((-1, 1), False)], ids=str)
@pytest.mark.parametrize("splits", [1, None], ids=["one-split", "auto-splits"])
@merge_paths
def test_cuda_kvcache_window(window, is_causal, splits, merge):
    """Decoding with a window: each split reads only the window's tiles (the
    first ones skipped), with the cluster and the global merge; a window wider
    than the cache bounds nothing; one with no left side hides keys on the right only."""
    skip_unless_runnable(merge=merge)
    q, k_cache, v_cache, _, k_new, v_new = cuda_cache(B=3, Hq=8, Hkv=2, d=128, max_len=3000, nq=3, n_new=3,
                                                      dtype=torch.bfloat16, seed=11)
    lens = torch.tensor([0, 1200, 2997], dtype=torch.int32, device="cuda")
    choices = {"num_splits": splits if splits else (4 if merge else None), "merge_in_cluster": merge}
    if splits == 1:
        choices["merge_in_cluster"] = None
    run_checked(q, k_cache, v_cache, lens, k_new, v_new, is_causal, window, **choices)


@pytest.mark.gpu
def test_cuda_kvcache_window_splits_follow_the_window():
    """The split count is planned for the keys a window reads, not the cache's capacity."""
    q, k_cache, v_cache, _, _, _ = cuda_cache(B=1, Hq=8, Hkv=8, d=64, max_len=65536, nq=1, n_new=0,
                                              dtype=torch.float16)
    full = fusedattn.plan_kvcache(q, k_cache, v_cache)
    windowed = fusedattn.plan_kvcache(q, k_cache, v_cache, window=(1023, 0))
    assert windowed["num_splits"] < full["num_splits"], (windowed, full)


@pytest.mark.gpu
def test_cuda_kvcache_split_count_follows_the_capacity_up_to_the_cap():
    """The planner's split rule sees the cache's capacity. Where the heads
    fill the GPU (B=8, Hkv=32) the tile cap asks for a split per 64 tiles of
    64 keys, but forces no more than 8 per block an SM holds: caches of 64K
    and 128K positions get one count, under the 32 that 128K got before the
    cap. Longer caches still get splits of at most 16K keys. 4K takes one
    split; a single head takes more to fill a wave; num_splits forces a
    count, cut to one split per 64 positions. Only shapes matter, so the
    caches are one position expanded (stride 0)."""

    def splits(batch, heads, capacity, num_splits=None):
        q = torch.zeros(batch, heads, 1, 128, device="cuda", dtype=torch.float16)
        k, v = (torch.zeros(batch, heads, 1, 128, device="cuda", dtype=torch.float16).expand(batch, heads, capacity, 128)
                for _ in range(2))
        return fusedattn.plan_kvcache(q, k, v, num_splits=num_splits)["num_splits"]

    assert splits(8, 32, 65536) == splits(8, 32, 131072) < 32
    assert splits(8, 32, 524288) > splits(8, 32, 131072) and 524288 // splits(8, 32, 524288) <= 16384
    assert splits(8, 32, 4096) == 1
    assert splits(1, 1, 131072) > splits(8, 32, 131072)
    assert splits(8, 32, 131072, num_splits=3) == 3
    assert splits(8, 32, 1000, num_splits=64) == 16  # ceil(1000 / 64)


@pytest.mark.gpu
@pytest.mark.parametrize("narrowed", [False, True], ids=["whole-cache", "narrowed-view"])
def test_cuda_kvcache_cache_far_longer_than_its_lengths(narrowed):
    """A cache of 64K positions holding a few hundred: the split count follows
    the capacity (more splits than for the narrowed view), and each split
    reads its share of the actual keys. A view narrowed to the positions in
    use (docs/semantics.md's advice for such caches) reads and appends in place, and
    leaves the rest of the cache alone."""
    q, k_cache, v_cache, _, k_new, v_new = cuda_cache(B=2, Hq=8, Hkv=2, d=128, max_len=65536, nq=1, n_new=1,
                                                      dtype=torch.float16)
    lengths = (300, 1000)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    k, v = (k_cache[:, :, :1024], v_cache[:, :, :1024]) if narrowed else (k_cache, v_cache)
    if narrowed:
        assert plan_of(q, k, v)["num_splits"] < plan_of(q, k_cache, v_cache)["num_splits"]
    k_rest, v_rest = k_cache[:, :, 1024:].clone(), v_cache[:, :, 1024:].clone()
    run_checked(q, k, v, lens, k_new, v_new, True)
    assert torch.equal(k_cache[:, :, 1024:], k_rest) and torch.equal(v_cache[:, :, 1024:], v_rest)
    for b, n in enumerate(lengths):
        assert torch.equal(k_cache[b, :, n], k_new[b, :, 0]) and torch.equal(v_cache[b, :, n], v_new[b, :, 0])


@pytest.mark.gpu
def test_cuda_kvcache_graph_capture_and_replay():
    """A captured step reads cache_seqlens and the new keys from their tensors at replay."""
    q, k_cache, v_cache, lens, k_new, v_new = cuda_cache(B=3, Hq=4, Hkv=2, d=64, max_len=600, nq=1,
                                                         n_new=1, dtype=torch.float16)
    lens.copy_(torch.tensor([5, 100, 300], dtype=torch.int32))
    static = [t.clone() for t in (q, lens, k_new, v_new)]
    graph_k, graph_v = k_cache.clone(), v_cache.clone()
    op(static[0], graph_k.clone(), graph_v.clone(), static[1], static[2], static[3])  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, _ = op(static[0], graph_k, graph_v, static[1], static[2], static[3])
    for step in range(3):
        for t in (static[0], static[2], static[3]):
            t.copy_(torch.randn_like(t))
        graph.replay()
        expected, _ = op(static[0], k_cache, v_cache, static[1], static[2], static[3])
        torch.testing.assert_close(graph_out, expected, atol=0, rtol=0)
        assert torch.equal(graph_k, k_cache) and torch.equal(graph_v, v_cache)
        static[1] += 1


@pytest.mark.gpu
@merge_paths
def test_cuda_kvcache_graphs_and_eager_calls_on_one_stream(merge):
    """The global split merge counts arrivals in counters that each call must
    find zeroed. Graphs captured one after another on one stream, replayed in
    the other order with eager calls on that stream before each replay, all
    give the eager answer bit for bit (the merge adds the splits in a fixed
    order); the same with the cluster merge (a cluster launch under capture)."""
    skip_unless_runnable(merge=merge)
    q, k_cache, v_cache, lens, _, _ = cuda_cache(B=3, Hq=8, Hkv=2, d=64, max_len=700, nq=1, n_new=0,
                                                 dtype=torch.float16)
    choices = {"num_splits": 4, "merge_in_cluster": merge}  # every item merges
    check_plan((q, k_cache, v_cache), choices, num_splits=4, merge_in_cluster=merge)
    expected = op(q, k_cache, v_cache, lens, None, None, True, None, **choices)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()  # no call ran on it before the captures
    graphs = []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outputs = op(q, k_cache, v_cache, lens, None, None, True, None, **choices)
        graphs.append((graph, outputs))
    for graph, (out, lse) in reversed(graphs):
        with torch.cuda.stream(stream):
            eager = op(q, k_cache, v_cache, lens, None, None, True, None, **choices)
        graph.replay()
        torch.cuda.synchronize()
        for got in ((out, lse), eager):
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.gpu
@pytest.mark.parametrize("splits,merge", [(1, None), (2, True), (2, False)],
                         ids=["one-split", "cluster-merge", "global-merge"])
def test_cuda_kvcache_out_of_range_lengths(splits, merge):
    """A sequence whose lengths do not fit gets NaN and no append; the others are unaffected.
    (CUDA does not read cache_seqlens on the host, so there is no exception.)"""
    skip_unless_runnable(merge=merge)
    q, k_cache, v_cache, lens, k_new, v_new = cuda_cache(B=3, Hq=4, Hkv=2, d=64, max_len=100, nq=1,
                                                         n_new=1, dtype=torch.float16)
    choices = {"num_splits": splits, "merge_in_cluster": merge}
    check_plan((q, k_cache, v_cache), choices, num_splits=splits, merge_in_cluster=bool(merge))
    before = k_cache.clone()
    bad = torch.tensor([10, 100, -1], dtype=torch.int32, device="cuda")
    out, lse = op(q, k_cache, v_cache, bad, k_new, v_new, **choices)
    assert out[1:].isnan().all() and lse[1:].isnan().all()
    assert not out[0].isnan().any()
    assert torch.equal(k_cache[1:], before[1:]) and torch.equal(k_cache[0, :, 10], k_new[0, :, 0])


@pytest.mark.gpu
def test_cuda_kvcache_layout_errors():
    q, k_cache, v_cache, lens, k_new, v_new = cuda_cache(B=2, Hq=4, Hkv=2, d=64, max_len=50, nq=1,
                                                         n_new=3, dtype=torch.float16)
    strided = torch.zeros(2, 2, 50, 128, device="cuda", dtype=torch.float16)[..., ::2]
    with pytest.raises(RuntimeError, match="k_cache and v_cache need a contiguous last dimension"):
        op(q, strided, v_cache, lens, k_new, v_new)
    # A contiguous cache whose rows start off 16 bytes cannot be read in
    # place, and a copy would lose the append.
    with pytest.raises(RuntimeError, match="rows starting on 16-byte boundaries"):
        op(q, at_odd_offset(k_cache), v_cache, lens, k_new, v_new)
    with pytest.raises(RuntimeError, match="cache_seqlens must be on q's device"):
        op(q, k_cache, v_cache, lens.cpu(), k_new, v_new)
    c = torch.zeros(2, 2, 50, 48, device="cuda", dtype=torch.float16)  # a head dim the decode kernel lacks
    assert fusedattn.plan_kvcache(q[..., :48], c, c.clone())["family"] == "gemm"  # tests/test_gemm_family.py
    # k_new laid out [B, Nnew, Hkv, d] (a transposed view, 3 rows) is read as given.
    k_t = k_new.transpose(1, 2).contiguous().transpose(1, 2)
    assert k_t.stride() != k_new.stride()
    expected, _ = op(q, k_cache.clone(), v_cache.clone(), lens, k_new, v_new)
    out, _ = op(q, k_cache, v_cache, lens, k_t, v_new)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
