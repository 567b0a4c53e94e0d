"""KV caches for the forward_kvcache tests and their check against the float64 reference."""

import torch

from fusedattn import reference

from .attention_cases import assert_within_rule
from .varlen_cases import offsets


def on_device(device, tensors):
    """The tensors (None stays None) on `device`."""
    return [t if t is None else t.to(device) for t in tensors]


def make_cache(B=3, Hq=4, Hkv=2, d=32, max_len=300, nq=1, n_new=1, dtype=torch.float32, seed=0, d_v=None):
    """q, the caches, their lengths and k_new, v_new; d_v: v's head dim (None: d)."""
    d_v = d if d_v is None else d_v
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    lens = torch.randint(0, max_len - n_new + 1, (B,), generator=g, dtype=torch.int32)
    lens[0] = 0  # an empty cache
    lens[-1] = max_len - n_new  # a full one
    k_cache, v_cache = rand(B, Hkv, max_len, d), rand(B, Hkv, max_len, d_v)
    new = (rand(B, Hkv, n_new, d), rand(B, Hkv, n_new, d_v)) if n_new else (None, None)
    return rand(B, Hq, nq, d), k_cache, v_cache, lens, *new


def check_against_reference(q, k_cache, v_cache, lens, k_new, v_new, is_causal, out, lse, window=None, softcap=None,
                            sinks=None):
    n_new = 0 if k_new is None else k_new.shape[2]
    dtype = q.dtype
    for b in range(q.shape[0]):
        end = int(lens[b]) + n_new
        k = k_cache[b:b + 1, :, :end]
        v = v_cache[b:b + 1, :, :end]
        args = (None, is_causal, None, window, softcap, sinks)
        oracle, oracle_lse = reference.attention_with_lse(q[b:b + 1].double(), k.double(), v.double(), *args)
        low, _ = reference.attention_with_lse(q[b:b + 1], k, v, *args)
        assert_within_rule(f"out[{b}]", out[b:b + 1], oracle, low, dtype, factor=2)
        hidden = oracle_lse == float("-inf")
        assert torch.equal(lse[b:b + 1] == float("-inf"), hidden)
        torch.testing.assert_close(lse[b:b + 1][~hidden].double(), oracle_lse[~hidden], atol=1e-4, rtol=1e-5)


def packed_cache(n_q, cached, Hq=4, Hkv=2, d=32, max_len=64, dtype=torch.float32, seed=0, appends=True,
                 device="cpu"):
    """Packed queries (n_q[b] of sequence b) against caches holding cached[b] positions: q
    [total_q, Hq, d], the caches [B, Hkv, max_len, d], cache_seqlens, cu_seqlens_q, and (appends)
    k_new, v_new [total_q, Hkv, d]."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    total, B = sum(n_q), len(n_q)
    cu = offsets(n_q, device)
    lens = torch.tensor(cached, dtype=torch.int32, device=device)
    new = (rand(total, Hkv, d), rand(total, Hkv, d)) if appends else (None, None)
    return rand(total, Hq, d), rand(B, Hkv, max_len, d), rand(B, Hkv, max_len, d), lens, cu, *new


def check_packed_kvcache(n_q, cached, is_causal=True, window=None, softcap=None, sinks=None, **kwargs):
    """forward_kvcache with cu_seqlens_q against the float64 reference, sequence by sequence: the
    appended rows land at cached[b].. and nothing else in the caches changes; out [total_q, Hq, d]
    and lse [Hq, total_q] per sequence as a dense call on its L_b positions."""
    q, k_cache, v_cache, lens, cu, k_new, v_new = packed_cache(n_q, cached, **kwargs)
    k_after, v_after = k_cache.clone(), v_cache.clone()
    out, lse = torch.ops.fusedattn.forward_kvcache(q, k_after, v_after, lens, k_new, v_new, is_causal, None, None,
                                                   None, None, window, softcap, sinks, cu)
    assert out.shape == (q.shape[0], q.shape[1], v_cache.shape[3]) and lse.shape == (q.shape[1], q.shape[0])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, (start, n) in enumerate(zip(cu[:-1].tolist(), n_q)):
        if k_new is not None:
            expected_k[b, :, cached[b]:cached[b] + n] = k_new[start:start + n].transpose(0, 1)
            expected_v[b, :, cached[b]:cached[b] + n] = v_new[start:start + n].transpose(0, 1)
    assert torch.equal(k_after, expected_k) and torch.equal(v_after, expected_v)
    for b, (start, n) in enumerate(zip(cu[:-1].tolist(), n_q)):
        if n == 0:
            continue
        end = cached[b] + (n if k_new is not None else 0)
        q_b = q[start:start + n].transpose(0, 1).unsqueeze(0)
        k_b, v_b = expected_k[b:b + 1, :, :end], expected_v[b:b + 1, :, :end]
        args = (None, is_causal, None, window, softcap, None if sinks is None else sinks.cpu())
        oracle, oracle_lse = reference.attention_with_lse(q_b.double().cpu(), k_b.double().cpu(), v_b.double().cpu(),
                                                          *args)
        low, _ = reference.attention_with_lse(q_b.cpu(), k_b.cpu(), v_b.cpu(), *args)
        out_b = out[start:start + n].transpose(0, 1).unsqueeze(0).cpu()
        assert_within_rule(f"out of sequence {b}", out_b, oracle, low, q.dtype, factor=2)
        lse_b = lse[:, start:start + n].unsqueeze(0).cpu()
        hidden = oracle_lse == float("-inf")
        assert torch.equal(lse_b == float("-inf"), hidden)
        torch.testing.assert_close(lse_b[~hidden].double(), oracle_lse[~hidden], atol=1e-4, rtol=1e-5)
    return out


def paged(k_cache, v_cache, page_size, spare_pages=3, seed=0):
    """The contiguous caches [B, Hkv, max_len, d] cut into pages [pages, Hkv, page_size, d] in a
    shuffled order (plus spare pages of noise), and the block table that reassembles them."""
    B, Hkv, max_len, d = k_cache.shape
    blocks = max_len // page_size
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(B * blocks + spare_pages, generator=g)[:B * blocks]
    pages = [torch.randn(B * blocks + spare_pages, Hkv, page_size, c.shape[3], generator=g).to(c)
             for c in (k_cache, v_cache)]
    for cache, paged_cache in zip((k_cache, v_cache), pages):
        pages_in_order = cache.reshape(B, Hkv, blocks, page_size, -1).permute(0, 2, 1, 3, 4)
        paged_cache[order.to(cache.device)] = pages_in_order.reshape(B * blocks, Hkv, page_size, -1)
    return pages[0], pages[1], order.view(B, blocks).to(device=k_cache.device, dtype=torch.int32)


def unpaged(pages, table):
    """The contiguous [B, Hkv, blocks * page_size, d] view of each sequence's pages."""
    p = pages[table.long()]  # [B, blocks, Hkv, page_size, d]
    return p.permute(0, 2, 1, 3, 4).reshape(table.shape[0], pages.shape[1], -1, pages.shape[3])
