"""What only the CPU forward is tested for: exact agreement with SDPA's math
and a broadcast mask that is never materialised."""

import torch

from helpers.attention_cases import Case, make_inputs
from fusedattn.memory import cpu_peak_bytes


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
