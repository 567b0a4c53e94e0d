"""A value head dim of its own (v [B, Hkv, Nk, d_v], out [B, Hq, Nq, d_v], d_v != d):
dense, kvcache and varlen on the CPU against the float64 reference, gradients,
fake functions, torch.compile. CUDA runs it padded: test_head_dims_cuda.py."""

import pytest
import torch

import fusedattn
from fusedattn import reference
from helpers.attention_cases import assert_within_rule
from helpers.kvcache_cases import check_against_reference, make_cache


def inputs(B=2, Hq=4, Hkv=2, Nq=37, Nk=53, d=16, d_v=24, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_(requires_grad)  # noqa: E731
    return rand(B, Hq, Nq, d), rand(B, Hkv, Nk, d), rand(B, Hkv, Nk, d_v)


CALLS = {  # (attn_mask maker, is_causal, window)
    "full": (None, False, None),
    "causal": (None, True, None),
    "window": (None, False, (9, 3)),
    "mask": (lambda nq, nk: torch.rand(nq, nk, generator=torch.Generator().manual_seed(1)) > 0.3, False, None),
}


@pytest.mark.parametrize("call", list(CALLS), ids=list(CALLS))
@pytest.mark.parametrize("d,d_v", [(16, 24), (64, 8), (32, 1), (8, 200)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_matches_reference(call, d, d_v, dtype):
    """Nq != Nk, GQA, d_v above and below d (down to 1, up past a tile of 128)."""
    q, k, v = inputs(d=d, d_v=d_v, dtype=dtype)
    make_mask, is_causal, window = CALLS[call]
    mask = None if make_mask is None else make_mask(q.shape[2], k.shape[2])
    out, lse = torch.ops.fusedattn.forward(q, k, v, mask, is_causal, None, window=window)
    assert out.shape == (2, 4, 37, d_v) and lse.shape == (2, 4, 37)
    oracle, oracle_lse = reference.attention_with_lse(q.double(), k.double(), v.double(), mask, is_causal, None,
                                                      window)
    low, _ = reference.attention_with_lse(q, k, v, mask, is_causal, None, window)
    assert_within_rule("out", out, oracle, low, dtype, factor=2)
    torch.testing.assert_close(lse.double(), oracle_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("call", list(CALLS), ids=list(CALLS))
@pytest.mark.parametrize("d,d_v", [(16, 40), (48, 8)], ids=str)
def test_gradients_match_reference(call, d, d_v):
    q, k, v = inputs(d=d, d_v=d_v, requires_grad=True, seed=2)
    make_mask, is_causal, window = CALLS[call]
    mask = None if make_mask is None else make_mask(q.shape[2], k.shape[2])
    out = fusedattn.attention(q, k, v, mask, is_causal, window=window)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    oracle = torch.autograd.grad(reference.attention(q64, k64, v64, mask, is_causal, None, window), (q64, k64, v64),
                                 grad_out.double())
    for name, a, o, like in zip(("dq", "dk", "dv"), grads, oracle, (q, k, v)):
        assert a.shape == like.shape
        torch.testing.assert_close(a.double(), o, atol=1e-4, rtol=1e-4, msg=name)


def test_kvcache_appends_and_attends_with_its_own_value_head_dim():
    q, k_cache, v_cache, lens, k_new, v_new = make_cache(d=16, d_v=40, nq=3, n_new=3, seed=4)
    out, lse = torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, lens, k_new, v_new, True)
    assert out.shape == (*q.shape[:3], 40)
    for b in range(q.shape[0]):
        assert torch.equal(v_cache[b, :, int(lens[b]):int(lens[b]) + 3], v_new[b])
    check_against_reference(q, k_cache, v_cache, lens, k_new, v_new, True, out, lse)


def test_varlen_with_its_own_value_head_dim():
    lengths_q, lengths_k = [5, 0, 17], [9, 4, 17]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lengths_q), 4, 16, generator=g, requires_grad=True)
    k = torch.randn(sum(lengths_k), 2, 16, generator=g, requires_grad=True)
    v = torch.randn(sum(lengths_k), 2, 8, generator=g, requires_grad=True)
    cu = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    cu_q, cu_k = cu(lengths_q), cu(lengths_k)
    out = fusedattn.attention_varlen(q, k, v, cu_q, cu_k, is_causal=True)
    assert out.shape == (sum(lengths_q), 4, 8)
    grad_out = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    seq = lambda t, c, b: t[int(c[b]):int(c[b + 1])].transpose(0, 1).unsqueeze(0)  # noqa: E731
    outs = [reference.attention(seq(q64, cu_q, b), seq(k64, cu_k, b), seq(v64, cu_k, b), is_causal=True)[0]
            .transpose(0, 1) for b in range(3)]
    torch.testing.assert_close(out.double(), torch.cat(outs), atol=1e-5, rtol=1e-5)
    oracle = torch.autograd.grad(torch.cat(outs), (q64, k64, v64), grad_out.double())
    for name, a, o in zip(("dq", "dk", "dv"), grads, oracle):
        torch.testing.assert_close(a.double(), o, atol=1e-4, rtol=1e-4, msg=name)


def test_fake_functions_and_compile():
    q, k, v = inputs(d=16, d_v=24, requires_grad=True, seed=6)
    torch.library.opcheck(torch.ops.fusedattn.forward.default, (q, k, v, None, True))
    q0, k0, v0 = (t.detach() for t in (q, k, v))
    out, lse = torch.ops.fusedattn.forward(q0, k0, v0, None, True)
    torch.library.opcheck(torch.ops.fusedattn.backward.default, (torch.randn_like(out), q0, k0, v0, out, lse, None,
                                                                 True))
    torch._dynamo.reset()
    compiled = torch.compile(fusedattn.attention, fullgraph=True)
    got = compiled(q, k, v, is_causal=True)
    torch.testing.assert_close(got, fusedattn.attention(q, k, v, is_causal=True), atol=0, rtol=0)
    got.sum().backward()
    assert v.grad.shape == v.shape


def test_mismatched_values_say_what_was_expected():
    q, k, v = inputs()
    with pytest.raises(RuntimeError, match=r"k and v must have the same \[B, Hkv, Nk\]"):
        torch.ops.fusedattn.forward(q, k, v[:, :, :5])
    with pytest.raises(RuntimeError, match=r"v's head dim d_v must be at least 1"):
        torch.ops.fusedattn.forward(q, k, v[..., :0])
    out, lse = torch.ops.fusedattn.forward(q, k, v)
    with pytest.raises(RuntimeError, match=r"grad_out must have the shape \[B, Hq, Nq, d_v\] = \[2, 4, 37, 24\]"):
        torch.ops.fusedattn.backward(torch.randn_like(q), q, k, v, out, lse)
