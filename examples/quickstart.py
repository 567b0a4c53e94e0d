"""fusedattn in ten lines: forward, backward, and a check against the naive oracle.

    python examples/quickstart.py
"""

import torch

import fusedattn

torch.manual_seed(0)
q = torch.randn(2, 8, 1000, 64, requires_grad=True)  # [B, Hq, Nq, d]
k = torch.randn(2, 2, 1200, 64, requires_grad=True)  # [B, Hkv, Nk, d]: grouped-query heads
v = torch.randn(2, 2, 1200, 64, requires_grad=True)
pad = torch.rand(2, 1, 1, 1200) > 0.1  # key padding, True = may attend

out = fusedattn.attention(q, k, v, attn_mask=pad, is_causal=True)
out.square().sum().backward()

q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
ref = fusedattn.reference.attention(q64, k64, v64, attn_mask=pad, is_causal=True)
ref.square().sum().backward()
print(f"out  max |fused - float64 reference| = {(out.double() - ref).abs().max():.2e}")
for name, a, b in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
    print(f"{name:4} max |fused - float64 reference| = {(a.double() - b).abs().max():.2e}")
