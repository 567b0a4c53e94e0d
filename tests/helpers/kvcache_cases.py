"""KV caches for the forward_kvcache tests and their check against the float64 reference."""

import torch

from fusedattn import reference

from .attention_cases import assert_within_rule


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
