"""What only the CPU forward is tested for: exact agreement with SDPA's math, a broadcast
mask that is never materialised, and tiles a mask hides that are never read."""

import pytest
import torch

import fusedattn
from fusedattn.memory import cpu_peak_bytes
from helpers.attention_cases import Case, make_inputs


def test_causal_equals_sdpa_when_square():
    case = Case(batch=1, heads_q=3, heads_kv=3, seqlen_q=300, seqlen_k=300, is_causal=True)
    q, k, v, _ = make_inputs(case)
    out, _ = torch.ops.fusedattn.forward(q, k, v, None, True, None)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_broadcast_mask_is_not_materialised():
    """A [B, 1, 1, Nk] mask expanded to a huge shape costs nothing (stride 0 is read as is)."""
    case = Case(batch=1, heads_q=64, heads_kv=64, seqlen_q=2048, seqlen_k=2048, head_dim=8)
    q, k, v, _ = make_inputs(case)
    mask = (torch.rand(1, 1, 1, 2048) > 0.5).expand(1, 64, 2048, 2048)  # 256 MiB if dense
    result = {}
    used = cpu_peak_bytes(lambda: result.update(out=torch.ops.fusedattn.forward(q, k, v, mask, False, None)[0]))
    out = result["out"]
    if used is not None:
        assert used < 64 * 2**20, f"forward used {used / 2**20:.0f} MiB: the mask was materialised?"
    dense = mask[:, :2].contiguous()
    expected, _ = torch.ops.fusedattn.forward(q[:, :2], k[:, :2], v[:, :2], dense, False, None)
    torch.testing.assert_close(out[:, :2], expected, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["bool", "float -inf"])
def test_tiles_a_mask_hides_are_never_read_forward_or_backward(kind):
    """Keys [256, 512) hidden from every query (one whole key tile of the forward, two of the
    backward) hold NaN: a kernel that read them would spread it (0 x NaN), one that skips them
    gives the attention over the other keys, and zero gradients for the hidden ones."""
    case = Case(batch=1, heads_q=2, heads_kv=2, seqlen_q=300, seqlen_k=768, head_dim=16)
    q, k, v, _ = make_inputs(case)
    hidden = torch.zeros(768, dtype=torch.bool)
    hidden[256:512] = True
    k[:, :, hidden] = float("nan")
    v[:, :, hidden] = float("nan")
    keep = ~hidden.expand(300, 768)
    mask = keep if kind == "bool" else torch.zeros(300, 768).masked_fill(~keep, float("-inf"))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fusedattn.attention(q, k, v, attn_mask=mask)
    out.square().sum().backward()
    seen = ~hidden
    kk, vv = (t.detach()[:, :, seen].requires_grad_() for t in (k, v))
    qq = q.detach().clone().requires_grad_()
    expected = fusedattn.attention(qq, kk, vv)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q.grad, qq.grad, atol=1e-4, rtol=1e-4)
    assert torch.equal(k.grad[:, :, hidden], torch.zeros_like(k.grad[:, :, hidden]))
    assert torch.equal(v.grad[:, :, hidden], torch.zeros_like(v.grad[:, :, hidden]))
    torch.testing.assert_close(k.grad[:, :, seen], kk.grad, atol=1e-4, rtol=1e-4)
