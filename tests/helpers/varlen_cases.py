"""Packed variable-length batches for the attention_varlen tests."""

import math

import torch

import fusedattn
from fusedattn import reference

from .attention_cases import assert_within_rule, stored_output_error


def packed(lengths_q, lengths_k, hq=4, hkv=2, d=16, dtype=torch.float32, seed=0, requires_grad=False, device="cpu",
           d_v=None):
    """q [total_q, hq, d], k [total_k, hkv, d], v [total_k, hkv, d_v] and the int32 offsets, on `device`."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype).requires_grad_(requires_grad)  # noqa: E731
    q, k, v = rand(sum(lengths_q), hq, d), rand(sum(lengths_k), hkv, d), rand(sum(lengths_k), hkv, d_v or d)
    return q, k, v, offsets(lengths_q, device), offsets(lengths_k, device)


def offsets(lengths, device="cpu"):
    """cu_seqlens of sequences of these lengths: int32 [B + 1] on `device`."""
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)


def tiles(lengths, tile):
    """The work items of sequences of these lengths cut into tiles of `tile` rows."""
    return sum(math.ceil(n / tile) for n in lengths)


def sequence(t, cu, b):
    """Sequence b of a packed [total, H, d] tensor as [1, H, n, d]."""
    return t[int(cu[b]):int(cu[b + 1])].transpose(0, 1).unsqueeze(0)


def check_varlen(lengths_q, lengths_k, is_causal=False, dtype=torch.float32, scale=None, window=None, softcap=None,
                 sinks=None, **kwargs):
    """forward_varlen of a packed batch against the float64 reference, sequence by sequence
    (computed on the CPU, whatever `device` the call ran on)."""
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, dtype=dtype, **kwargs)
    out, lse = torch.ops.fusedattn.forward_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), is_causal,
                                                  scale, fusedattn.backends.forced().family, window=window,
                                                  softcap=softcap, sinks=sinks)
    assert out.shape == (*q.shape[:2], v.shape[2]) and lse.shape == (q.shape[1], q.shape[0])
    assert lse.dtype == torch.float32 and out.device == q.device
    q, k, v, cu_q, cu_k, out, lse = (t.cpu() for t in (q, k, v, cu_q, cu_k, out, lse))
    sinks = None if sinks is None else sinks.cpu()
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


def check_varlen_backward(lengths_q, lengths_k, is_causal=False, dtype=torch.float32, scale=None, window=None,
                          sinks=None, softcap=None, **kwargs):
    """Gradients of q, k, v (and the sinks) through attention_varlen against autograd of the
    reference, sequence by sequence, in float64 (the oracle) and in the input dtype, with the
    tolerance rule of helpers.attention_cases.check_backward."""
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, dtype=dtype, requires_grad=True, **kwargs)
    device = q.device
    if sinks is not None:
        sinks = sinks.to(device).requires_grad_()
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    out = fusedattn.attention_varlen(q, k, v, cu_q, cu_k, is_causal=is_causal, scale=scale, window=window,
                                     softcap=softcap, sinks=sinks)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(device=device, dtype=dtype)
    grads = [g.cpu() for g in torch.autograd.grad(out, inputs, grad_out)]
    cu_q, cu_k, grad_out = cu_q.cpu(), cu_k.cpu(), grad_out.cpu()

    def packed_reference(ts, dout):
        outs = [reference.attention(sequence(ts[0], cu_q, b), sequence(ts[1], cu_k, b), sequence(ts[2], cu_k, b),
                                    None, is_causal, scale, window, softcap, ts[3] if len(ts) > 3 else None)[0]
                .transpose(0, 1) for b in range(len(lengths_q))]
        if not torch.cat(outs).requires_grad:  # no sequence has keys: the outputs are constant zeros
            return tuple(torch.zeros_like(t) for t in ts)
        return torch.autograd.grad(torch.cat(outs), ts, dout, allow_unused=True, materialize_grads=True)

    inputs64 = [t.detach().cpu().double().requires_grad_() for t in inputs]
    inputs_low = [t.detach().cpu().clone().requires_grad_() for t in inputs]
    oracle, low = packed_reference(inputs64, grad_out.double()), packed_reference(inputs_low, grad_out)
    magnitude = max([1.0] + [o.abs().max().item() for o in oracle[:3] if o.numel()])
    extras = [0.0] * 4  # stored_output_error per sequence, the largest
    for b in range(len(lengths_q)):
        seq = [sequence(t.detach(), cu, b) for t, cu in zip(inputs64[:3], (cu_q, cu_k, cu_k))]
        if seq[0].shape[2] == 0 or seq[1].shape[2] == 0:
            continue
        sinks64 = inputs64[3].detach() if sinks is not None else None
        errors = stored_output_error(*seq, sequence(grad_out.double(), cu_q, b),
                                     (None, is_causal, scale, window, softcap, sinks64), dtype)
        extras = [max(e, x) for e, x in zip(extras, errors)]
    for name, a, o, lp, like, extra in zip(("dq", "dk", "dv", "dsinks"), grads, oracle, low, inputs, extras):
        assert a.shape == like.shape and a.dtype == like.dtype, name
        assert_within_rule(name, a, o, lp, dtype, factor=3, scale=magnitude, extra=extra)
