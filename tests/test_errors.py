"""Bad input raises an error that says what was expected and what was given."""

import pytest
import torch

import fusedattn


def qkv(B=2, Hq=4, Hkv=2, Nq=8, Nk=10, d=16, dtype=torch.float32):
    return (torch.randn(B, Hq, Nq, d, dtype=dtype), torch.randn(B, Hkv, Nk, d, dtype=dtype),
            torch.randn(B, Hkv, Nk, d, dtype=dtype))


def fwd(q, k, v, mask=None, causal=False, scale=None):
    return torch.ops.fusedattn.forward(q, k, v, mask, causal, scale)


BAD_FORWARD = {
    "q rank": (lambda q, k, v: fwd(q[0], k, v), r"q must be a 4-D tensor .*got a tensor of shape \[4, 8, 16\]"),
    "k rank": (lambda q, k, v: fwd(q, k[..., None], v), r"k must be a 4-D tensor"),
    "batch": (lambda q, k, v: fwd(q[:1], k, v), r"same batch size, got q \[1, 4, 8, 16\] and k \[2, 2, 10, 16\]"),
    "head dim": (lambda q, k, v: fwd(q[..., :8], k, v), r"same head dim d"),
    "k v shape": (lambda q, k, v: fwd(q, k, v[:, :, :5]), r"k and v must have the same \[B, Hkv, Nk\]"),
    "heads": (lambda q, k, v: fwd(q[:, :3], k, v), r"multiple of .*Hq = 3 and Hkv = 2"),
    "dtype mix": (lambda q, k, v: fwd(q, k.half(), v), r"one dtype, got q Float, k Half, v Float"),
    "float64": (lambda q, k, v: fwd(q.double(), k.double(), v.double()), r"on CPU q, k and v must be one of .*got Double"),
    "int": (lambda q, k, v: fwd(q.int(), k.int(), v.int()), r"must be one of .*got Int"),
    "mask shape": (lambda q, k, v: fwd(q, k, v, torch.ones(8, 9, dtype=torch.bool)), r"attn_mask must broadcast to \[B, Hq, Nq, Nk\] = \[2, 4, 8, 10\], got shape \[8, 9\]"),
    "mask rank": (lambda q, k, v: fwd(q, k, v, torch.ones(1, 2, 4, 8, 10, dtype=torch.bool)), r"attn_mask must broadcast"),
    "mask dtype": (lambda q, k, v: fwd(q, k, v, torch.ones(8, 10, dtype=torch.int64)), r"attn_mask must be bool .* or floating point .*got Long"),
    "scale": (lambda q, k, v: fwd(q, k, v, None, False, float("nan")), r"scale must be finite"),
    "huge scale": (lambda q, k, v: fwd(q, k, v, None, False, -1e300),
                   r"scale must be finite and at most 2.35\d*e\+38 in magnitude, got -1e\+300"),
    "empty head dim": (lambda q, k, v: fwd(q[..., :0], k[..., :0], v[..., :0]), r"head dim d must be at least 1"),
    "no kv heads": (lambda q, k, v: fwd(q, k[:, :0], v[:, :0]), r"multiple of"),
}


@pytest.mark.parametrize("name", BAD_FORWARD)
def test_bad_forward_input(name):
    call, pattern = BAD_FORWARD[name]
    with pytest.raises(RuntimeError, match=pattern):
        call(*qkv())


def test_devices_must_match():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to mix devices")
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="one device"):
        fwd(q, k.cuda(), v)


META_MIXES = {
    "forward attn_mask": lambda q, k, v: fwd(q, k, v, torch.ones(8, 10, dtype=torch.bool, device="meta")),
    "forward sinks": lambda q, k, v: fusedattn.attention(q, k, v, sinks=torch.zeros(4, device="meta")),
    "forward k": lambda q, k, v: fwd(q, k.to("meta"), v),
    "backward lse": lambda q, k, v: torch.ops.fusedattn.backward(q, q, k, v, q, torch.zeros(2, 4, 8, device="meta")),
    "kvcache cache_seqlens": lambda q, k, v: torch.ops.fusedattn.forward_kvcache(
        q, k, v, torch.zeros(2, dtype=torch.int32, device="meta")),
    "varlen cu_seqlens_k": lambda q, k, v: torch.ops.fusedattn.forward_varlen(
        q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), torch.tensor([0, 8], dtype=torch.int32),
        torch.tensor([0, 10], dtype=torch.int32, device="meta"), 8, 10),
}


@pytest.mark.parametrize("name", sorted(META_MIXES))
def test_a_meta_tensor_among_real_ones_is_refused(name):
    """One argument on meta makes the dispatcher run the fake function instead of the kernel;
    it must refuse the mix, not return uninitialised memory as the result."""
    with pytest.raises(RuntimeError, match=r"must be on the device of q \(cpu\), got meta"):
        META_MIXES[name](*qkv())


def test_bad_backward_input():
    q, k, v = qkv()
    out, lse = fwd(q, k, v)
    g = torch.randn_like(out)
    bwd = torch.ops.fusedattn.backward
    with pytest.raises(RuntimeError, match=r"grad_out must have the shape \[B, Hq, Nq, d_v\] = \[2, 4, 8, 16\] .*got \[2, 4, 7, 16\]"):
        bwd(g[:, :, :7], q, k, v, out, lse)
    with pytest.raises(RuntimeError, match=r"out must have the dtype of q \(Float\), got Half"):
        bwd(g, q, k, v, out.half(), lse)
    with pytest.raises(RuntimeError, match=r"lse must have shape \[B, Hq, Nq\] = \[2, 4, 8\], got \[2, 4\]"):
        bwd(g, q, k, v, out, lse[..., 0])
    with pytest.raises(RuntimeError, match=r"lse must be float32, got Double"):
        bwd(g, q, k, v, out, lse.double())


def test_python_entry_point_raises_the_same_errors():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="multiple of"):
        fusedattn.attention(q[:, :3], k, v)
