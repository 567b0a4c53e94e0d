"""Packed variable-length batches for the attention_varlen tests."""

import torch

from fusedattn import reference

from .attention_cases import assert_within_rule


def packed(lengths_q, lengths_k, hq=4, hkv=2, d=16, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_(requires_grad)  # noqa: E731
    q, k, v = rand(sum(lengths_q), hq, d), rand(sum(lengths_k), hkv, d), rand(sum(lengths_k), hkv, d)
    offsets = lambda lengths: torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)  # noqa: E731
    return q, k, v, offsets(lengths_q), offsets(lengths_k)


def sequence(t, cu, b):
    """Sequence b of a packed [total, H, d] tensor as [1, H, n, d]."""
    return t[int(cu[b]):int(cu[b + 1])].transpose(0, 1).unsqueeze(0)


def check_varlen(lengths_q, lengths_k, is_causal=False, dtype=torch.float32, scale=None, window=None, softcap=None,
                 sinks=None, **kwargs):
    """forward_varlen of a packed batch against the float64 reference, sequence by sequence."""
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, dtype=dtype, **kwargs)
    out, lse = torch.ops.fusedattn.forward_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), is_causal,
                                                  scale, window=window, softcap=softcap, sinks=sinks)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    for b in range(len(lengths_q)):
        args = (sequence(q, cu_q, b), sequence(k, cu_k, b), sequence(v, cu_k, b))
        options = (None, is_causal, scale, window, softcap, sinks)
        oracle, oracle_lse = reference.attention_with_lse(*(t.double() for t in args), *options)
        low, _ = reference.attention_with_lse(*args, *options)
        assert_within_rule(f"out of sequence {b}", sequence(out, cu_q, b), oracle, low, dtype, factor=2)
        got_lse = lse[:, int(cu_q[b]):int(cu_q[b + 1])]
        hidden = oracle_lse[0] == float("-inf")
        assert torch.equal(got_lse == float("-inf"), hidden)
        torch.testing.assert_close(got_lse[~hidden].double(), oracle_lse[0][~hidden], atol=1e-4, rtol=1e-5)
