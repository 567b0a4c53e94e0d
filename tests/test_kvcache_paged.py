"""forward_kvcache with block_table: the caches as pages shared by the sequences, on the CPU and
on CUDA (the decode kernel reads, and the append writes, the pages the table names; marker `gpu`).
A paged call answers bit for bit as the same call on contiguous caches and appends into the pages
the table names. CUDA reads no entry on the host: one outside the cache gives its sequence NaN and
no append."""

import pytest
import torch

import fusedattn
from helpers.kvcache_cases import make_cache, on_device, packed_cache, paged, unpaged

op = torch.ops.fusedattn.forward_kvcache


def paged_variants():
    """(device, page_size, d, dtype, max_len, num_splits): the CPU at small pages (1 position
    too); CUDA at its multiples of 16, with the planner's split count, one split and five."""
    cases = [pytest.param("cpu", p, 32, dtype, 64, None, id=f"cpu-page{p}-{str(dtype)[6:]}")
             for p in (1, 8, 16) for dtype in (torch.float32, torch.bfloat16)]
    cases += [pytest.param("cuda", p, d, dtype, 1024, s, marks=pytest.mark.gpu,
                           id=f"cuda-page{p}-d{d}-{str(dtype)[6:]}-splits{s or 'auto'}")
              for p in (16, 64, 256) for d, dtype in ((64, torch.float16), (128, torch.bfloat16))
              for s in (None, 1, 5)]
    return cases


@pytest.mark.parametrize("nq, n_new", [(1, 1), (4, 4), (3, 0)], ids=["decode", "chunk", "no-append"])
@pytest.mark.parametrize("device, page_size, d, dtype, max_len, num_splits", paged_variants())
def test_paged_equals_contiguous_bit_for_bit(nq, n_new, device, page_size, d, dtype, max_len, num_splits):
    q, k_cache, v_cache, lens, k_new, v_new = on_device(device, make_cache(B=3, Hq=8, Hkv=2, d=d, max_len=max_len,
                                                                           nq=nq, n_new=n_new, dtype=dtype,
                                                                           seed=page_size))
    k_pages, v_pages, table = paged(k_cache, v_cache, page_size, seed=nq)
    plan = fusedattn.plan_kvcache(q, k_pages, v_pages, lens, k_new, v_new, num_splits=num_splits, block_table=table)
    assert plan["family"] == ("cpu" if device == "cpu" else "decode"), plan
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
    # The appends landed in the pages the table names, and nothing else changed.
    assert torch.equal(unpaged(k_pages, table), k_cache) and torch.equal(unpaged(v_pages, table), v_cache)
    assert torch.equal(k_pages[spare].isnan(), spares_before[0].isnan())
    assert torch.equal(v_pages[spare].isnan(), spares_before[1].isnan())


# (queries, cached positions, head dim, dtype, cache length, page size) per device.
PACKED = {"cpu": ([3, 0, 1, 6], [10, 5, 31, 0], 32, torch.float32, 40, 8),
          "cuda": ([3, 0, 1, 70], [100, 5, 300, 0], 64, torch.float16, 512, 16)}


def test_packed_queries_through_pages(device):
    """Chunked prefill beside decoding (cu_seqlens_q) reads the pages (gathered per sequence on
    CUDA), with the bits of the contiguous call; the appends land in the pages."""
    n_q, cached, d, dtype, max_len, page_size = PACKED[device]
    q, k_cache, v_cache, lens, cu, k_new, v_new = packed_cache(n_q, cached, d=d, max_len=max_len, dtype=dtype,
                                                               device=device)
    k_pages, v_pages, table = paged(k_cache, v_cache, page_size=page_size)
    plan = fusedattn.plan_kvcache(q, k_pages, v_pages, lens, k_new, v_new, cu_seqlens_q=cu, block_table=table)
    assert plan["varlen"], plan
    expected = op(q, k_cache, v_cache, lens, k_new, v_new, True, None, cu_seqlens_q=cu)
    got = op(q, k_pages, v_pages, lens, k_new, v_new, True, None, cu_seqlens_q=cu, block_table=table)
    for e, g in zip(expected, got):
        assert torch.equal(g, e)
    assert torch.equal(unpaged(k_pages, table), k_cache) and torch.equal(unpaged(v_pages, table), v_cache)
    with pytest.raises(RuntimeError, match=r"block_table\[3, 0\] = -1 holds positions of sequence 3"):
        op(q, k_pages, v_pages, lens, k_new, v_new, cu_seqlens_q=cu,
           block_table=torch.cat([table[:3], torch.full_like(table[3:], -1)]))


@pytest.mark.parametrize("packed", [False, True], ids=["decode", "packed"])
def test_sequences_past_one_gathers_positions_are_gathered_in_groups(packed):
    """The CPU gathers the pages of neighbouring sequences together up to 16384 positions: sequences of
    9000, 9000, 0 and 100 cached positions make two gathers (the empty one in the second) and answer
    as the contiguous caches do."""
    cached = [9000, 9000, 0, 100]
    if packed:
        q, k_cache, v_cache, lens, cu, k_new, v_new = packed_cache([1, 2, 0, 1], cached, Hq=2, Hkv=1, d=16,
                                                                   max_len=9008)
        extra = {"cu_seqlens_q": cu}
    else:
        q, k_cache, v_cache, _, k_new, v_new = make_cache(B=4, Hq=2, Hkv=1, d=16, max_len=9008, nq=1, n_new=1)
        lens, extra = torch.tensor(cached, dtype=torch.int32), {}
    k_pages, v_pages, table = paged(k_cache, v_cache, page_size=16)
    expected = op(q, k_cache, v_cache, lens, k_new, v_new, True, None, **extra)
    got = op(q, k_pages, v_pages, lens, k_new, v_new, True, None, block_table=table, **extra)
    for e, g in zip(expected, got):
        assert torch.equal(g, e)


def test_a_non_contiguous_block_table():
    q, k_cache, v_cache, lens, k_new, v_new = make_cache(max_len=32, nq=2, n_new=2)
    k_pages, v_pages, table = paged(k_cache, v_cache, page_size=4)
    wide = torch.stack([table, torch.full_like(table, -1)], dim=2).flatten(1)[:, ::2]  # column stride 2
    assert not wide.is_contiguous() and torch.equal(wide, table)
    expected = op(q, k_cache, v_cache, lens, k_new, v_new)
    for e, g in zip(expected, op(q, k_pages, v_pages, lens, k_new, v_new, block_table=wide)):
        assert torch.equal(g, e)


def test_the_python_wrapper_decodes_through_pages():
    """Token-by-token decoding into pages allocated as the sequences grow (their pages interleaved
    in the pool) equals one causal pass."""
    torch.manual_seed(0)
    B, H, d, n, page_size = 2, 4, 16, 21, 4
    q, k, v = (torch.randn(B, H, n, d) for _ in range(3))
    full = fusedattn.attention(q, k, v, is_causal=True)
    blocks = -(-n // page_size)
    k_pages, v_pages = torch.zeros(B * blocks, H, page_size, d), torch.zeros(B * blocks, H, page_size, d)
    table = torch.arange(B * blocks, dtype=torch.int32).view(blocks, B).t().contiguous()  # b's pages: b, b + B, ..
    lens = torch.zeros(B, dtype=torch.int32)
    for t in range(n):
        step = fusedattn.attention_with_kvcache(q[:, :, t:t + 1], k_pages, v_pages, lens, k[:, :, t:t + 1],
                                                v[:, :, t:t + 1], block_table=table)
        torch.testing.assert_close(step, full[:, :, t:t + 1], atol=1e-6, rtol=1e-6)
        lens += 1


def test_a_partly_filled_page_may_be_read_by_several_sequences():
    """Sequences that append nothing only read their pages, full or not: a shared last page
    (lengths 3 and 2 of page size 4) is no conflict, dense or packed (an empty sequence)."""
    torch.manual_seed(2)
    H, d = 2, 8
    k_pages, v_pages = torch.randn(3, H, 4, d), torch.randn(3, H, 4, d)
    table = torch.tensor([[0, 1], [0, 2]], dtype=torch.int32)
    lens = torch.tensor([3, 2], dtype=torch.int32)
    q = torch.randn(2, H, 1, d)
    k_cache, v_cache = unpaged(k_pages, table), unpaged(v_pages, table)
    for e, g in zip(op(q, k_cache, v_cache, lens), op(q, k_pages, v_pages, lens, block_table=table)):
        assert torch.equal(g, e)
    cu = torch.tensor([0, 0, 1], dtype=torch.int32)  # sequence 0 has no queries, so no new keys
    q1, k1, v1 = torch.randn(1, H, d), torch.randn(1, H, d), torch.randn(1, H, d)
    table = torch.tensor([[0, 1], [2, 1]], dtype=torch.int32)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    k_cache, v_cache = unpaged(k_pages, table).clone(), unpaged(v_pages, table).clone()
    expected = op(q1, k_cache, v_cache, lens, k1, v1, cu_seqlens_q=cu)
    for e, g in zip(expected, op(q1, k_pages, v_pages, lens, k1, v1, cu_seqlens_q=cu, block_table=table)):
        assert torch.equal(g, e)


def test_sequences_may_share_prefix_pages():
    """Two sequences read the same first page (a shared prompt) and append into pages of their own."""
    torch.manual_seed(1)
    H, d, page_size = 2, 8, 4
    k_pages, v_pages = torch.randn(5, H, page_size, d), torch.randn(5, H, page_size, d)
    table = torch.tensor([[0, 1, 3], [0, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([6, 5], dtype=torch.int32)
    q, k_new, v_new = torch.randn(2, H, 1, d), torch.randn(2, H, 1, d), torch.randn(2, H, 1, d)
    k_cache, v_cache = unpaged(k_pages, table).clone(), unpaged(v_pages, table).clone()
    expected = op(q, k_cache, v_cache, lens, k_new, v_new, True, None)
    got = op(q, k_pages, v_pages, lens, k_new, v_new, True, None, block_table=table)
    for e, g in zip(expected, got):
        assert torch.equal(g, e)
    assert torch.equal(k_pages[1, :, 2], k_new[0, :, 0]) and torch.equal(k_pages[2, :, 1], k_new[1, :, 0])


def test_bad_block_tables():
    H, d, page_size = 2, 8, 4
    k_pages, v_pages = torch.randn(4, H, page_size, d), torch.randn(4, H, page_size, d)
    q, k_new, v_new = torch.randn(2, H, 1, d), torch.randn(2, H, 1, d), torch.randn(2, H, 1, d)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    before, v_before = k_pages.clone(), v_pages.clone()
    with pytest.raises(RuntimeError, match=r"block_table must be int32 \[B, max_blocks\] = \[2, max_blocks\], got Long"):
        op(q, k_pages, v_pages, lens, k_new, v_new, block_table=table.long())
    with pytest.raises(RuntimeError, match=r"block_table must be int32 .* got Int \[3, 2\]"):
        op(q, k_pages, v_pages, lens, k_new, v_new, block_table=torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"block_table\[1, 1\] = 7 holds positions of sequence 1 but the caches "
                                           r"have pages 0 .. 3"):
        op(q, k_pages, v_pages, lens, k_new, v_new, block_table=torch.tensor([[0, 1], [2, 7]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="sequences 0 and 1 both append into page 1"):
        op(q, k_pages, v_pages, torch.tensor([4, 5], dtype=torch.int32), k_new, v_new,
           block_table=torch.tensor([[0, 1], [2, 1]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="sequence 0 appends into page 0, which sequence 1 reads"):
        op(q, k_pages, v_pages, lens, k_new, v_new, block_table=torch.tensor([[0, 1], [0, 3]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="sequence 1 has 8 cached positions and 1 new ones, but the cache holds 8"):
        op(q, k_pages, v_pages, torch.tensor([3, 8], dtype=torch.int32), k_new, v_new, block_table=table)
    with pytest.raises(RuntimeError, match=r"block_table\[1, 0\] and block_table\[1, 1\] are both page 2"):
        op(q, k_pages, v_pages, lens, k_new, v_new, block_table=torch.tensor([[0, 1], [2, 2]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="scale must be finite"):
        op(q, k_pages, v_pages, lens, k_new, v_new, True, float("nan"), block_table=table)
    with pytest.raises(RuntimeError, match="sequence 1 appends into page 1, which sequence 0 reads"):
        op(q[:1].transpose(1, 2).reshape(1, H, d), k_pages, v_pages, torch.tensor([5, 4], dtype=torch.int32),
           k_new[:1, :, 0], v_new[:1, :, 0],
           cu_seqlens_q=torch.tensor([0, 0, 1], dtype=torch.int32),
           block_table=torch.tensor([[0, 1], [2, 1]], dtype=torch.int32))
    assert torch.equal(k_pages, before) and torch.equal(v_pages, v_before)  # every refusal before any append
    # Unused entries of the table are not read: -1 past a sequence's pages is fine.
    op(q, k_pages, v_pages, torch.tensor([0, 1], dtype=torch.int32), k_new, v_new,
       block_table=torch.tensor([[0, -1], [2, -1]], dtype=torch.int32))


def test_the_fake_function_and_compile():
    q, k_cache, v_cache, lens, k_new, v_new = make_cache(max_len=32, nq=2, n_new=2)
    k_pages, v_pages, table = paged(k_cache, v_cache, page_size=8)
    torch.library.opcheck(op.default, (q, k_pages.clone(), v_pages.clone(), lens, k_new, v_new, True, None),
                          {"block_table": table})
    torch._dynamo.reset()
    k_e, v_e = k_pages.clone(), v_pages.clone()
    expected = op(q, k_e, v_e, lens, k_new, v_new, block_table=table)[0]
    compiled = torch.compile(fusedattn.attention_with_kvcache, fullgraph=True)
    k_c, v_c = k_pages.clone(), v_pages.clone()
    assert torch.equal(compiled(q, k_c, v_c, lens, k_new, v_new, block_table=table), expected)
    assert torch.equal(k_c, k_e) and torch.equal(v_c, v_e)  # the in-place appends survive compilation
    assert not torch.equal(k_c, k_pages)


def test_plan_kvcache_takes_the_block_table():
    """The CPU's plan of a paged call: a table of the wrong batch, a paged cache passed without
    its table and a table too short for the lengths are refused."""
    q, k_cache, v_cache, lens, k_new, v_new = make_cache(max_len=32)
    k_pages, v_pages, table = paged(k_cache, v_cache, page_size=8)
    assert fusedattn.plan_kvcache(q, k_pages, v_pages, lens, k_new, v_new, block_table=table)["family"] == "cpu"
    with pytest.raises(RuntimeError, match=r"block_table must be int32 \[B, max_blocks\] = \[3, max_blocks\]"):
        fusedattn.plan_kvcache(q, k_pages, v_pages, block_table=table[:2])
    with pytest.raises(RuntimeError, match="the caches hold 15 sequences but the call has 3 .or pass block_table"):
        op(q, k_pages, v_pages, lens, k_new, v_new)
    n_q, cached = [2, 1, 0], [3, 30, 0]
    q, k_cache, v_cache, lens, cu, k_new, v_new = packed_cache(n_q, cached, max_len=32)
    k_pages, v_pages, table = paged(k_cache, v_cache, page_size=8)
    plan = fusedattn.plan_kvcache(q, k_pages, v_pages, lens, k_new, v_new, cu_seqlens_q=cu, block_table=table)
    assert plan["family"] == "cpu" and plan["varlen"]
    with pytest.raises(RuntimeError, match="sequence 1 has 31 cached positions and 0 new ones, but the cache holds 24"):
        fusedattn.plan_kvcache(q, k_pages, v_pages, lens, k_new, v_new, cu_seqlens_q=cu, block_table=table[:, :3])


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits, merge_in_cluster", [(1, None), (4, False), (4, True)],
                         ids=["one-split", "global-merge", "cluster-merge"])
@pytest.mark.parametrize("bad", ["read", "append"])
def test_a_page_outside_the_cache_gives_its_sequence_nan(num_splits, merge_in_cluster, bad):
    """Sequence 1 (200 positions, appending at 200) reads a bad entry at page 3, or appends through
    one at page 12 (its last page, which it reads too): NaN for it alone; no write through the bad entry."""
    q, k_cache, v_cache, lens, k_new, v_new = on_device("cuda", make_cache(B=3, Hq=4, Hkv=2, d=64, max_len=512,
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


@pytest.mark.gpu
def test_pages_of_a_multiple_of_16_positions_only():
    q, k_cache, v_cache, lens, k_new, v_new = on_device("cuda", make_cache(max_len=64, d=64, dtype=torch.float16))
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


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("window, is_causal", [((100, 0), False), ((700, 0), False), ((-1, 1), False),
                                               (None, False), (None, True)], ids=str)
def test_every_band_through_pages(window, is_causal):
    """Each of the decode kernel's band variants (both sides, the right only, none) reads pages
    as it reads a contiguous cache; four queries, so that a right side of 1 hides keys."""
    q, k_cache, v_cache, lens, k_new, v_new = on_device("cuda", make_cache(B=3, Hq=8, Hkv=2, d=64, max_len=1024,
                                                                  nq=4, n_new=4, dtype=torch.float16))
    k_pages, v_pages, table = paged(k_cache, v_cache, 16)
    expected = op(q, k_cache, v_cache, lens, k_new, v_new, is_causal, window=window)
    got = op(q, k_pages, v_pages, lens, k_new, v_new, is_causal, window=window, block_table=table)
    for e, g in zip(expected, got):
        assert torch.equal(g, e)
    if window is not None or is_causal:  # the band hides keys of the longer sequences
        unbanded = op(q, k_cache.clone(), v_cache.clone(), lens, k_new, v_new, False)[0]
        assert not torch.equal(unbanded[1:], expected[0][1:])
