"""Forward correctness on the CPU against the float64 reference."""

import pytest
import torch
from hypothesis import given

from helpers.attention_cases import DTYPES, MASK_KINDS, Case, cases, check_forward, make_inputs
from fusedattn.memory import cpu_peak_bytes

AWKWARD = [1, 7, 97, 113, 256, 257, 1025]


@given(cases())
def test_forward_random_cases(case):
    check_forward(case)


@pytest.mark.parametrize("mask", MASK_KINDS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_mask_kind(mask, is_causal, dtype):
    check_forward(Case(seqlen_q=113, seqlen_k=97, dtype=dtype, mask=mask, is_causal=is_causal))
    # Long enough for key_block_holes to hide whole 256-key tiles.
    check_forward(Case(batch=1, seqlen_q=300, seqlen_k=900, dtype=dtype, mask=mask,
                       is_causal=is_causal))


@pytest.mark.parametrize("n", AWKWARD)
@pytest.mark.parametrize("is_causal", [False, True])
def test_awkward_lengths(n, is_causal):
    # Nq = n against a different Nk, both sides of every tile boundary.
    check_forward(Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=n, seqlen_k=n + 3,
                       head_dim=64, is_causal=is_causal))
    check_forward(Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=n, seqlen_k=max(1, n // 2),
                       head_dim=64, is_causal=is_causal, mask="key_padding"))


@pytest.mark.parametrize("head_dim", [1, 2, 5, 31, 32, 64, 100, 128, 200, 256])
def test_head_dims(head_dim):
    check_forward(Case(head_dim=head_dim, seqlen_q=70, seqlen_k=300, mask="bool"))


@pytest.mark.parametrize("heads", [(8, 1), (6, 2), (4, 4)], ids=["mqa", "gqa", "mha"])
def test_grouped_query_heads(heads):
    check_forward(Case(heads_q=heads[0], heads_kv=heads[1], seqlen_q=300, seqlen_k=520,
                       is_causal=True))


def test_causal_is_bottom_right():
    # Nq < Nk: the last query sees every key; Nq > Nk: the first Nq - Nk rows see nothing.
    for nq, nk in [(5, 300), (300, 5), (257, 256)]:
        _, lse = check_forward(Case(seqlen_q=nq, seqlen_k=nk, is_causal=True))
        assert lse.isinf().any() == (nq > nk)


def test_causal_equals_sdpa_when_square():
    case = Case(batch=1, heads_q=3, heads_kv=3, seqlen_q=300, seqlen_k=300, is_causal=True)
    q, k, v, _ = make_inputs(case)
    out, _ = torch.ops.fusedattn.forward(q, k, v, None, True, None)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_all_keys_masked_gives_zero_and_minus_inf():
    case = Case(mask="bool")
    q, k, v, _ = make_inputs(case)
    mask = torch.zeros(case.seqlen_q, case.seqlen_k, dtype=torch.bool)
    out, lse = torch.ops.fusedattn.forward(q, k, v, mask, False, None)
    assert (out == 0).all() and (lse == float("-inf")).all()
    # Empty key sequence: the same.
    out, lse = torch.ops.fusedattn.forward(q, k[:, :, :0], v[:, :, :0], None, False, None)
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_additive_mask_of_another_float_dtype():
    case = Case(dtype=torch.bfloat16, mask="additive")
    q, k, v, mask = make_inputs(case)
    for mask_dtype in (torch.float32, torch.float64, torch.float16):
        out, lse = torch.ops.fusedattn.forward(q, k, v, mask.to(mask_dtype), False, None)
        check_forward(case, out=out, lse=lse)


def test_arbitrary_strides():
    """[B, N, H, d] memory viewed as [B, H, N, d], a sliced head dim and an expanded batch."""
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=130, head_dim=32, mask="bool")
    q, k, v, mask = make_inputs(case)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_wide = torch.cat([k, torch.randn_like(k)], dim=-1)[..., :32]  # row stride 64
    v_cols = v.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim not contiguous
    out, lse = torch.ops.fusedattn.forward(q_t, k_wide, v_cols, mask, False, None)
    check_forward(case, out=out, lse=lse)
    # A batch broadcast with stride 0 reads the same rows for every batch entry.
    k0 = k[:1].expand_as(k)
    out, _ = torch.ops.fusedattn.forward(q, k0, v[:1].expand_as(v), None, False, None)
    out1, _ = torch.ops.fusedattn.forward(q[1:], k[:1], v[:1], None, False, None)
    torch.testing.assert_close(out[1:], out1, atol=0, rtol=0)


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


def test_large_scale_does_not_overflow():
    # Scores around 1e4: the online softmax must subtract the running max.
    check_forward(Case(scale=300.0, seqlen_q=60, seqlen_k=600, mask="additive"))


@pytest.mark.parametrize("scale", [0.0, -0.7])
@pytest.mark.parametrize("is_causal", [False, True])
def test_zero_and_negative_scales(scale, is_causal):
    # A scale of 0 gives every visible key the same weight; a negative one
    # favours the lowest scores. Masked keys stay hidden either way.
    check_forward(Case(scale=scale, seqlen_q=40, seqlen_k=90, is_causal=is_causal, mask="bool"))


def test_finfo_min_mask_counts_as_minus_inf():
    """Documented rule: an additive value that overflows to -inf in base-2 units
    (float32's finfo.min) hides its key exactly like -inf does."""
    q, k, v, _ = make_inputs(Case())
    hidden = torch.rand(q.shape[2], k.shape[2]) < 0.3
    hidden[0] = True  # one row hidden entirely: out 0, lse -inf
    with_inf = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))
    with_min = torch.zeros(hidden.shape).masked_fill(hidden, torch.finfo(torch.float32).min)
    out_inf, lse_inf = torch.ops.fusedattn.forward(q, k, v, with_inf, False, None)
    out_min, lse_min = torch.ops.fusedattn.forward(q, k, v, with_min, False, None)
    torch.testing.assert_close(out_min, out_inf, atol=0, rtol=0)
    torch.testing.assert_close(lse_min, lse_inf, atol=0, rtol=0)
    assert (out_min[:, :, 0] == 0).all() and (lse_min[:, :, 0] == float("-inf")).all()
