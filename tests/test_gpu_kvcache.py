"""forward_kvcache on CUDA (the split-KV decode kernels) against the float64
reference (marker `gpu`)."""

import os
import subprocess
import sys

import pytest
import torch

import fusedattn
from test_gpu import GPU_DTYPES, HEAD_DIMS, at_odd_offset, poison_allocator
from test_kvcache import check_against_reference, make_cache

pytestmark = pytest.mark.gpu
op = torch.ops.fusedattn.forward_kvcache

# Both ways the splits of a row tile merge: in a thread block cluster ("1":
# required, so the call raises if it cannot; sm_90, 2-8 splits, every cluster
# of the grid at once, as in these tests' small grids), or through global
# memory ("0": the last split to arrive merges).
merge_paths = pytest.mark.parametrize("merge", ["1", "0"], ids=["cluster-merge", "global-merge"])


def set_merge_path(monkeypatch, merge):
    """merge None: the automatic choice, whatever the environment said."""
    if merge == "1" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("thread block clusters need sm_90")
    if merge is None:
        monkeypatch.delenv("FUSEDATTN_DECODE_CLUSTER_MERGE", raising=False)
    else:
        monkeypatch.setenv("FUSEDATTN_DECODE_CLUSTER_MERGE", merge)


def cuda_cache(**kwargs):
    return [t if t is None else t.cuda() for t in make_cache(**kwargs)]


def run_checked(q, k_cache, v_cache, lens, k_new, v_new, is_causal):
    """One call, with the outputs poisoned, the append and the untouched rest of the caches checked."""
    n_new = 0 if k_new is None else k_new.shape[2]
    k_before, v_before = k_cache.clone(), v_cache.clone()
    poison_allocator((q.shape, q.dtype), (q.shape[:3], torch.float32))
    out, lse = op(q, k_cache, v_cache, lens, k_new, v_new, is_causal, None)
    for b in range(q.shape[0]):
        start, end = int(lens[b]), int(lens[b]) + n_new
        if n_new:
            assert torch.equal(k_cache[b, :, start:end], k_new[b])
            assert torch.equal(v_cache[b, :, start:end], v_new[b])
        for cache, before in ((k_cache, k_before), (v_cache, v_before)):
            assert torch.equal(cache[b, :, :start], before[b, :, :start])
            assert torch.equal(cache[b, :, end:], before[b, :, end:])
    check_against_reference(q, k_cache, v_cache, lens, k_new, v_new, is_causal, out, lse)
    return out, lse


@pytest.mark.parametrize("nq", [1, 2, 7])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("splits", ["1", None], ids=["one-split", "auto-splits"])
def test_cuda_kvcache_matches_reference(monkeypatch, nq, heads, dtype, head_dim, is_causal, splits):
    """Both output paths: one split (the decode kernel writes out and lse) and
    the automatic count (about 10 splits here, merged by the last block of each head)."""
    if splits:
        monkeypatch.setenv("FUSEDATTN_DECODE_SPLITS", splits)
    # max_len 700: several 64-key tiles, lengths from 0 (empty) to full.
    args = cuda_cache(B=4, Hq=heads[0], Hkv=heads[1], d=head_dim, max_len=700, nq=nq, n_new=nq,
                      dtype=dtype, seed=nq + head_dim)
    run_checked(*args, is_causal)


@pytest.mark.parametrize("splits", ["1", "3", "64"])
def test_cuda_kvcache_forced_splits(monkeypatch, splits):
    """Every split count gives the reference's answer, also splits with no keys."""
    monkeypatch.setenv("FUSEDATTN_DECODE_SPLITS", splits)
    args = cuda_cache(B=3, Hq=8, Hkv=2, d=64, max_len=1500, nq=2, n_new=2, dtype=torch.float16)
    run_checked(*args, True)


@pytest.mark.parametrize("merge", [None, "0"], ids=["cluster-merge-where-it-fits", "global-merge"])
def test_cuda_kvcache_split_merge_is_exact(monkeypatch, merge):
    """Merging splits equals one pass up to float32 rounding. With q = 0 every
    score is 0 and every probability exactly 1, so no split rounds P
    differently (with random scores P is rounded to float16 against each
    split's own running max, a difference within the tolerance rule that the
    forced-splits test covers); v holds small integers, whose sums are exact."""
    q, k_cache, v_cache, lens, _, _ = cuda_cache(B=3, Hq=8, Hkv=8, d=128, max_len=4096, nq=1, n_new=0,
                                                 dtype=torch.float16)
    q.zero_()
    v_cache.copy_(torch.randint(1, 9, v_cache.shape, device="cuda"))
    set_merge_path(monkeypatch, merge)
    results = {}
    for splits in ("1", "5", "32"):
        monkeypatch.setenv("FUSEDATTN_DECODE_SPLITS", splits)
        results[splits] = op(q, k_cache, v_cache, lens, None, None, True, None)
    one_out, one_lse = results["1"]
    for b in range(q.shape[0]):  # the mean of each sequence's values, in float64
        expected = v_cache[b, :, :lens[b]].double().mean(dim=1, keepdim=True)
        if lens[b] > 0:
            torch.testing.assert_close(one_out[b].double(), expected, atol=0, rtol=2**-10)
    for splits in ("5", "32"):
        out, lse = results[splits]
        torch.testing.assert_close(out, one_out, atol=0, rtol=2**-10)  # one float16 rounding apart at most
        torch.testing.assert_close(lse, one_lse, atol=0, rtol=1e-6)


@pytest.mark.parametrize("splits", ["2", "3", "4", "8"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_cuda_kvcache_cluster_and_global_merge_agree(monkeypatch, splits, head_dim):
    """FUSEDATTN_DECODE_CLUSTER_MERGE=1 makes the splits of a row tile merge
    in a thread block cluster from each other's shared memory (and raises
    where they cannot: so this fails if the cluster path is not taken);
    =0 makes the last split merge through global memory. Both merge the same
    float32 partials with the same code, so they agree bit for bit, and match
    the reference (Nq = 7 with 4 heads a group gives two row tiles; at 8
    splits some splits have no keys). Below sm_90 only the global merge runs,
    against the reference."""
    monkeypatch.setenv("FUSEDATTN_DECODE_SPLITS", splits)
    args = cuda_cache(B=3, Hq=8, Hkv=2, d=head_dim, max_len=1500, nq=7, n_new=7, dtype=torch.float16,
                      seed=int(splits))
    set_merge_path(monkeypatch, "0")
    global_out, global_lse = run_checked(*args, True)
    if torch.cuda.get_device_capability() < (9, 0):
        return
    set_merge_path(monkeypatch, "1")
    out, lse = op(*args, True, None)  # appends the same rows at the same places again
    assert torch.equal(out, global_out) and torch.equal(lse, global_lse)


@pytest.mark.parametrize("value,splits,message", [
    ("yes", "4", "must be 0, 1 or unset, got 'yes'"),
    ("yes", "1", "must be 0, 1 or unset, got 'yes'"),  # checked on every call
    ("1", "16", "it has 16"),
])
def test_cuda_kvcache_cluster_merge_setting_errors(monkeypatch, value, splits, message):
    """A bad FUSEDATTN_DECODE_CLUSTER_MERGE, or =1 where the splits cannot
    merge in clusters (16 splits: more than a cluster holds), raises instead
    of silently taking the other path. (One split merges nothing: =1 has
    nothing to refuse there.)"""
    monkeypatch.setenv("FUSEDATTN_DECODE_SPLITS", splits)
    monkeypatch.setenv("FUSEDATTN_DECODE_CLUSTER_MERGE", value)
    q, k_cache, v_cache, lens, _, _ = cuda_cache(B=2, Hq=8, Hkv=2, d=64, max_len=1500, nq=1, n_new=0,
                                                 dtype=torch.float16)
    # The kernel layer throws std::invalid_argument; which Python type that
    # becomes through torch.ops is torch's choice (this passed on the H200,
    # 2026-12-01, as one of the two).
    with pytest.raises((ValueError, RuntimeError), match=message):
        op(q, k_cache, v_cache, lens, None, None, True, None)


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


@merge_paths
def test_cuda_kvcache_back_to_back_calls_agree(monkeypatch, merge):
    """Decode kernels one after another with no kernel between them: each may
    be scheduled while the one before ends, and, merging globally, reuses its
    arrival counters (and, through the caching allocator, its partial
    buffers). Every call gives the first one's answer bit for bit."""
    monkeypatch.setenv("FUSEDATTN_DECODE_SPLITS", "4")
    set_merge_path(monkeypatch, merge)
    q, k_cache, v_cache, lens, _, _ = cuda_cache(B=3, Hq=8, Hkv=2, d=128, max_len=4096, nq=1, n_new=0,
                                                 dtype=torch.float16)
    expected = op(q, k_cache, v_cache, lens, None, None, True, None)
    torch.cuda.synchronize()
    results = [op(q, k_cache, v_cache, lens, None, None, True, None) for _ in range(16)]
    torch.cuda.synchronize()
    for out, lse in results:
        assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


@pytest.mark.parametrize("lengths", [[4096, 4096], [1, 8192], [0, 5000]])
def test_cuda_kvcache_long_caches(lengths):
    """The automatic split count on long caches, with per-sequence lengths (an empty one too)."""
    q, k_cache, v_cache, _, _, _ = cuda_cache(B=2, Hq=32, Hkv=8, d=128, max_len=8192, nq=1, n_new=0,
                                              dtype=torch.float16)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    run_checked(q, k_cache, v_cache, lens, None, None, True)


def test_cuda_kvcache_split_count_follows_the_capacity_up_to_the_cap(monkeypatch):
    """The host's split rule sees the cache's capacity. Where the heads fill
    the GPU (B=8, Hkv=32) the tile cap asks for a split per 64 tiles of 64
    keys, but forces no more than 8 per block an SM holds: caches of 64K and
    128K positions get one count, under the 32 that 128K got before the cap.
    Longer caches still get splits of at most 16K keys. 4K takes one split; a
    single head takes more to fill a wave; and FUSEDATTN_DECODE_SPLITS forces
    a count. Only shapes matter, so the caches are one position expanded
    (stride 0)."""
    monkeypatch.delenv("FUSEDATTN_DECODE_SPLITS", raising=False)

    def splits(batch, heads, capacity):
        q = torch.zeros(batch, heads, 1, 128, device="cuda", dtype=torch.float16)
        cache = torch.zeros(batch, heads, 1, 128, device="cuda", dtype=torch.float16)
        return torch.ops.fusedattn.decode_num_splits(q, cache.expand(batch, heads, capacity, 128))

    assert splits(8, 32, 65536) == splits(8, 32, 131072) < 32
    assert splits(8, 32, 524288) > splits(8, 32, 131072) and 524288 // splits(8, 32, 524288) <= 16384
    assert splits(8, 32, 4096) == 1
    assert splits(1, 1, 131072) > splits(8, 32, 131072)
    monkeypatch.setenv("FUSEDATTN_DECODE_SPLITS", "3")
    assert splits(8, 32, 131072) == 3


@pytest.mark.parametrize("narrowed", [False, True], ids=["whole-cache", "narrowed-view"])
def test_cuda_kvcache_cache_far_longer_than_its_lengths(narrowed):
    """A cache of 64K positions holding a few hundred: the split count follows
    the capacity, and each split reads its share of the actual keys. A view
    narrowed to the positions in use (the README's advice for such caches)
    reads and appends in place, and leaves the rest of the cache alone."""
    q, k_cache, v_cache, _, k_new, v_new = cuda_cache(B=2, Hq=8, Hkv=2, d=128, max_len=65536, nq=1, n_new=1,
                                                      dtype=torch.float16)
    lengths = (300, 1000)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    k, v = (k_cache[:, :, :1024], v_cache[:, :, :1024]) if narrowed else (k_cache, v_cache)
    k_rest, v_rest = k_cache[:, :, 1024:].clone(), v_cache[:, :, 1024:].clone()
    run_checked(q, k, v, lens, k_new, v_new, True)
    assert torch.equal(k_cache[:, :, 1024:], k_rest) and torch.equal(v_cache[:, :, 1024:], v_rest)
    for b, n in enumerate(lengths):
        assert torch.equal(k_cache[b, :, n], k_new[b, :, 0]) and torch.equal(v_cache[b, :, n], v_new[b, :, 0])


def test_cuda_kvcache_decode_loop_equals_causal_forward():
    torch.manual_seed(0)
    B, Hq, Hkv, d, n = 2, 8, 2, 64, 70
    q = torch.randn(B, Hq, n, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(B, Hkv, n, d, device="cuda", dtype=torch.float16) for _ in range(2))
    full = fusedattn.attention(q, k, v, is_causal=True)
    k_cache, v_cache = (torch.zeros(B, Hkv, n, d, device="cuda", dtype=torch.float16) for _ in range(2))
    lens = torch.zeros(B, dtype=torch.int32, device="cuda")
    for t in range(n):
        step = fusedattn.attention_with_kvcache(q[:, :, t:t + 1], k_cache, v_cache, lens,
                                                k[:, :, t:t + 1], v[:, :, t:t + 1])
        torch.testing.assert_close(step, full[:, :, t:t + 1], atol=2e-3, rtol=2e-3)
        lens += 1


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


@merge_paths
def test_cuda_kvcache_graphs_and_eager_calls_on_one_stream(monkeypatch, merge):
    """The global split merge counts arrivals in counters that each call must
    find zeroed. Graphs captured one after another on one stream, replayed in
    the other order with eager calls on that stream before each replay, all
    give the eager answer bit for bit (the merge adds the splits in a fixed
    order); the same with the cluster merge (a cluster launch under capture)."""
    monkeypatch.setenv("FUSEDATTN_DECODE_SPLITS", "4")  # every item merges
    set_merge_path(monkeypatch, merge)
    q, k_cache, v_cache, lens, _, _ = cuda_cache(B=3, Hq=8, Hkv=2, d=64, max_len=700, nq=1, n_new=0,
                                                 dtype=torch.float16)
    expected = op(q, k_cache, v_cache, lens, None, None, True, None)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()  # no call ran on it before the captures
    graphs = []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outputs = op(q, k_cache, v_cache, lens, None, None, True, None)
        graphs.append((graph, outputs))
    for graph, (out, lse) in reversed(graphs):
        with torch.cuda.stream(stream):
            eager = op(q, k_cache, v_cache, lens, None, None, True, None)
        graph.replay()
        torch.cuda.synchronize()
        for got in ((out, lse), eager):
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("splits,merge", [("1", None), ("2", "1"), ("2", "0")],
                         ids=["one-split", "cluster-merge", "global-merge"])
def test_cuda_kvcache_out_of_range_lengths(monkeypatch, splits, merge):
    """A sequence whose lengths do not fit gets NaN and no append; the others are unaffected.
    (CUDA does not read cache_seqlens on the host, so there is no exception.)"""
    monkeypatch.setenv("FUSEDATTN_DECODE_SPLITS", splits)
    set_merge_path(monkeypatch, merge)
    q, k_cache, v_cache, lens, k_new, v_new = cuda_cache(B=3, Hq=4, Hkv=2, d=64, max_len=100, nq=1,
                                                         n_new=1, dtype=torch.float16)
    before = k_cache.clone()
    bad = torch.tensor([10, 100, -1], dtype=torch.int32, device="cuda")
    out, lse = op(q, k_cache, v_cache, bad, k_new, v_new)
    assert out[1:].isnan().all() and lse[1:].isnan().all()
    assert not out[0].isnan().any()
    assert torch.equal(k_cache[1:], before[1:]) and torch.equal(k_cache[0, :, 10], k_new[0, :, 0])


def run_this_file_with(env, *pytest_args):
    """This file's tests in a subprocess with `env` added (and no inherited
    PYTEST_ADDOPTS, which could name this run's report file): the decode
    block's warps are chosen at the first decode call of a process."""
    child_env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, *pytest_args],
                          cwd=os.path.dirname(__file__), env={**child_env, **env}, capture_output=True,
                          text=True, timeout=900)


def test_cuda_kvcache_four_warp_blocks_at_d128():
    """At d=128 a decode block has 8 warps where it can hold their 192 KB
    ring (H100, H200) and 4 where it cannot (an A100 gives a block 163 KB).
    FUSEDATTN_DECODE_WARPS=4 runs this whole file through the 4-warp blocks
    on any GPU (other head dims have 8 warps only); =5 raises, and so does =8
    where 8 warps do not fit."""
    done = run_this_file_with({"FUSEDATTN_DECODE_WARPS": "4"}, "-x", "-k", "not four_warp_blocks")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
    bad = run_this_file_with({"FUSEDATTN_DECODE_WARPS": "5"}, "-x", "-k", "matches_reference and 128")
    assert bad.returncode != 0 and "must be 4, 8 or unset, got '5'" in bad.stdout
    if torch.cuda.get_device_properties(0).shared_memory_per_block_optin < 200704:  # 8 warps' Q and ring
        eight = run_this_file_with({"FUSEDATTN_DECODE_WARPS": "8"}, "-x", "-k", "matches_reference and 128")
        assert eight.returncode != 0 and "8 warps need 200704 bytes at d=128" in eight.stdout


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
    with pytest.raises(RuntimeError, match=r"the head dim must be one of \[32, 64, 128\]; got 48"):
        c = torch.zeros(2, 2, 50, 48, device="cuda", dtype=torch.float16)
        op(q[..., :48], c, c.clone(), lens)
    # k_new laid out [B, Nnew, Hkv, d] (a transposed view, 3 rows) is read as given.
    k_t = k_new.transpose(1, 2).contiguous().transpose(1, 2)
    assert k_t.stride() != k_new.stride()
    expected, _ = op(q, k_cache.clone(), v_cache.clone(), lens, k_new, v_new)
    out, _ = op(q, k_cache, v_cache, lens, k_t, v_new)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_cuda_kvcache_opcheck_and_compile():
    q, k_cache, v_cache, lens, k_new, v_new = cuda_cache(B=2, Hq=4, Hkv=2, d=64, max_len=200, nq=2,
                                                         n_new=2, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.fusedattn.forward_kvcache.default,
                          (q, k_cache.clone(), v_cache.clone(), lens, k_new, v_new, True, None))
    torch._dynamo.reset()
    expected_k = k_cache.clone()
    expected, _ = op(q, expected_k, v_cache.clone(), lens, k_new, v_new)
    compiled = torch.compile(fusedattn.attention_with_kvcache, fullgraph=True)
    k_c, v_c = k_cache.clone(), v_cache.clone()
    torch.testing.assert_close(compiled(q, k_c, v_c, lens, k_new, v_new), expected, atol=0, rtol=0)
    assert torch.equal(k_c, expected_k)
