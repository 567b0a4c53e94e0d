"""forward_kvcache with block_table on CUDA: the decode kernel reads (and the append writes) the
pages the table names, so a paged call gives the bits of the same call on contiguous caches; packed
queries gather each sequence's pages first. Entries are not read on the host: one outside the cache
gives its sequence NaN and no append."""

import pytest
import torch

import fusedattn
from helpers.kvcache_cases import make_cache, packed_cache, paged, unpaged

pytestmark = pytest.mark.gpu
op = torch.ops.fusedattn.forward_kvcache


def on_cuda(*tensors):
    return [None if t is None else t.cuda() for t in tensors]


@pytest.mark.parametrize("nq, n_new", [(1, 1), (4, 4), (3, 0)], ids=["decode", "chunk", "no-append"])
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("d, dtype", [(64, torch.float16), (128, torch.bfloat16)], ids=["d64-fp16", "d128-bf16"])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_paged_equals_contiguous_bit_for_bit(nq, n_new, page_size, d, dtype, num_splits):
    q, k_cache, v_cache, lens, k_new, v_new = on_cuda(*make_cache(B=3, Hq=8, Hkv=2, d=d, max_len=1024, nq=nq,
                                                                  n_new=n_new, dtype=dtype, seed=page_size))
    k_pages, v_pages, table = paged(k_cache, v_cache, page_size, seed=nq)
    plan = fusedattn.plan_kvcache(q, k_pages, v_pages, lens, k_new, v_new, num_splits=num_splits, block_table=table)
    assert plan["family"] == "decode"
    spare = sorted(set(range(k_pages.shape[0])) - set(table.flatten().tolist()))
    # Entries past a sequence's pages are never read: -1 there, and NaN in the pages nobody holds.
    sparse = table.clone()
    for b, length in enumerate((lens + n_new).tolist()):
        sparse[b, -(-length // page_size):] = -1
    k_pages[spare] = v_pages[spare] = float("nan")
    spares_before = k_pages[spare].clone(), v_pages[spare].clone()
    expected = op(q, k_cache, v_cache, lens, k_new, v_new, True, None, num_splits)
    got = op(q, k_pages, v_pages, lens, k_new, v_new, True, None, num_splits, block_table=sparse)
    for e, g in zip(expected, got):
        assert torch.equal(g, e)
    assert torch.equal(unpaged(k_pages, table), k_cache) and torch.equal(unpaged(v_pages, table), v_cache)
    assert torch.equal(k_pages[spare].isnan(), spares_before[0].isnan())
    assert torch.equal(v_pages[spare].isnan(), spares_before[1].isnan())


@pytest.mark.parametrize("num_splits, merge_in_cluster", [(1, None), (4, False), (4, True)],
                         ids=["one-split", "global-merge", "cluster-merge"])
@pytest.mark.parametrize("bad", ["read", "append"])
def test_a_page_outside_the_cache_gives_its_sequence_nan(num_splits, merge_in_cluster, bad):
    """Sequence 1 (200 positions, appending at 200) reads a bad entry at page 3, or appends through
    one at page 12 (its last page, which it reads too): NaN for it alone; no write through the bad entry."""
    q, k_cache, v_cache, lens, k_new, v_new = on_cuda(*make_cache(B=3, Hq=4, Hkv=2, d=64, max_len=512,
                                                                  dtype=torch.float16))
    lens[:] = torch.tensor([300, 200, 100], dtype=torch.int32)
    k_pages, v_pages, table = paged(k_cache, v_cache, 16)
    expected = op(q, k_cache.clone(), v_cache.clone(), lens, k_new, v_new, True, None, num_splits, merge_in_cluster)
    before = k_pages.clone()
    appends = {b: int(table[b, int(lens[b]) // 16]) for b in range(3)}
    if bad == "read":
        table[1, 3] = k_pages.shape[0]
    else:
        table[1, 12] = -1
        del appends[1]
    out, lse = op(q, k_pages, v_pages, lens, k_new, v_new, True, None, num_splits, merge_in_cluster,
                  block_table=table)
    assert out[1].isnan().all() and lse[1].isnan().all()
    for b in (0, 2):
        assert torch.equal(out[b], expected[0][b]) and torch.equal(lse[b], expected[1][b])
    changed = (k_pages != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == sorted(appends.values())


def test_pages_of_a_multiple_of_16_positions_only():
    q, k_cache, v_cache, lens, k_new, v_new = on_cuda(*make_cache(max_len=64, d=64, dtype=torch.float16))
    k_pages, v_pages, table = paged(k_cache, v_cache, 8)
    with pytest.raises(RuntimeError, match="on CUDA a paged KV cache's pages hold a multiple of 16 positions .* got "
                                           "page_size 8"):
        op(q, k_pages, v_pages, lens, k_new, v_new, block_table=table)
    with pytest.raises(RuntimeError, match=r"block_table must be int32 \[B, max_blocks\] = \[3, max_blocks\]"):
        op(q, k_pages, v_pages, lens, k_new, v_new, block_table=table[:2])
    k16, v16, table16 = paged(k_cache, v_cache, 16)
    odd = torch.empty(k16.numel() + 4 * k16.shape[0], device="cuda", dtype=k16.dtype)  # pages 4 elements apart
    k_odd = odd.view(k16.shape[0], -1)[:, :k16[0].numel()].unflatten(1, k16.shape[1:])
    with pytest.raises(RuntimeError, match="pages of k_cache and v_cache must start on 16-byte boundaries"):
        op(q, k_odd, v16, lens, k_new, v_new, block_table=table16)
    cpu = [t.cpu() for t in (q, k_pages, v_pages, lens, k_new, v_new)]
    with pytest.raises(RuntimeError, match=r"block_table must be on q's device \(cpu\), got cuda:0"):
        op(*cpu, block_table=table)


def test_packed_queries_through_pages():
    """Chunked prefill beside decoding (cu_seqlens_q) reads the pages gathered per sequence, with
    the bits of the contiguous call; the appends land in the pages."""
    n_q, cached = [3, 0, 1, 70], [100, 5, 300, 0]
    q, k_cache, v_cache, lens, cu, k_new, v_new = packed_cache(n_q, cached, d=64, max_len=512, dtype=torch.float16,
                                                               device="cuda")
    k_pages, v_pages, table = paged(k_cache, v_cache, page_size=16)
    plan = fusedattn.plan_kvcache(q, k_pages, v_pages, lens, k_new, v_new, cu_seqlens_q=cu, block_table=table)
    assert plan["varlen"]
    expected = op(q, k_cache, v_cache, lens, k_new, v_new, True, None, cu_seqlens_q=cu)
    got = op(q, k_pages, v_pages, lens, k_new, v_new, True, None, cu_seqlens_q=cu, block_table=table)
    for e, g in zip(expected, got):
        assert torch.equal(g, e)
    assert torch.equal(unpaged(k_pages, table), k_cache) and torch.equal(unpaged(v_pages, table), v_cache)
    with pytest.raises(RuntimeError, match=r"block_table\[3, 0\] = -1 holds positions of sequence 3"):
        op(q, k_pages, v_pages, lens, k_new, v_new, cu_seqlens_q=cu,
           block_table=torch.cat([table[:3], torch.full_like(table[3:], -1)]))


def test_a_paged_decoding_step_replays_from_a_cuda_graph():
    """The lengths and the table are read on the device: a captured step follows both in place."""
    B, H, d, page_size, n = 4, 8, 64, 16, 40
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    full = fusedattn.attention(q, k, v, is_causal=True)
    blocks = -(-n // page_size)
    k_pages = torch.zeros(B * blocks, H, page_size, d, device="cuda", dtype=torch.float16)
    v_pages = torch.zeros_like(k_pages)
    table = torch.randperm(B * blocks, device="cuda").view(B, blocks).int()
    lens = torch.zeros(B, dtype=torch.int32, device="cuda")
    static = [t[:, :, :1].clone() for t in (q, k, v)]

    def step():
        return fusedattn.attention_with_kvcache(static[0], k_pages, v_pages, lens, static[1], static[2],
                                                block_table=table)

    step()  # warm-up; the capture below records without running
    k_pages.zero_(), v_pages.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for t in range(n):
        for s, x in zip(static, (q, k, v)):
            s.copy_(x[:, :, t:t + 1])
        graph.replay()
        torch.testing.assert_close(out, full[:, :, t:t + 1], atol=2e-3, rtol=2e-3)
        lens += 1


@pytest.mark.parametrize("window", [(100, 0), (700, 0)])
def test_a_sliding_window_through_pages(window):
    q, k_cache, v_cache, lens, k_new, v_new = on_cuda(*make_cache(B=3, Hq=8, Hkv=2, d=64, max_len=1024,
                                                                  dtype=torch.float16))
    k_pages, v_pages, table = paged(k_cache, v_cache, 16)
    expected = op(q, k_cache, v_cache, lens, k_new, v_new, window=window)
    got = op(q, k_pages, v_pages, lens, k_new, v_new, window=window, block_table=table)
    for e, g in zip(expected, got):
        assert torch.equal(g, e)
    unwindowed = op(q, k_cache.clone(), v_cache.clone(), lens, k_new, v_new)[0]
    assert not torch.equal(unwindowed[1:], expected[0][1:])  # the window hides keys of the longer sequences
