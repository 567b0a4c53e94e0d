"""The forward's features on every backend (the `backend` fixture: cpu, and
the sm80 and sm90 families with marker `gpu`) against the float64 reference.
What only one device has is in test_forward_cpu.py, test_forward_cuda.py and
test_forward_sm90.py."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fusedattn
from helpers.attention_cases import DTYPES, MASK_KINDS, Case, cases, check_forward
from helpers.kernel_table import FEATURE_HEAD_DIMS


@given(st.data())
# (@given fills the rightmost parameters; the backend holds for every example)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_cases(backend, data):
    """Random shapes, masks and scales; on CUDA at the dtypes and head dims it takes."""
    if backend.device == "cpu":
        case = data.draw(cases())
    else:
        case = dataclasses.replace(data.draw(cases(max_len=1100)), dtype=data.draw(st.sampled_from(backend.dtypes)),
                                   head_dim=data.draw(st.sampled_from(FEATURE_HEAD_DIMS)))
    backend.check_forward(case)


@pytest.mark.parametrize("mask", MASK_KINDS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", FEATURE_HEAD_DIMS)
def test_every_mask_kind(backend, mask, is_causal, dtype, head_dim):
    # Nk >= 800 reaches past the key_block_holes mask's hidden tiles (keys 256-767).
    for batch, nq, nk in ((2, 113, 97), (2, 113, 800), (1, 300, 900)):
        backend.check_forward(Case(batch=batch, seqlen_q=nq, seqlen_k=nk, head_dim=head_dim, dtype=dtype, mask=mask,
                                   is_causal=is_causal))


@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 1025), (7, 10), (7, 300), (300, 7), (97, 113), (113, 56), (128, 128),
                                   (129, 64), (256, 259), (257, 128), (1025, 512), (1025, 1025), (2048, 1000)])
@pytest.mark.parametrize("mask", ["none", "key_padding"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", FEATURE_HEAD_DIMS)
def test_awkward_lengths(backend, nq, nk, mask, is_causal, head_dim):
    """Both sides of every tile boundary, Nq against a different Nk."""
    # The CPU takes one batch of 2/1 heads (the float64 reference is the cost there) and
    # leaves 2048 x 1000 to CUDA.
    if backend.device == "cpu" and nq * nk > 2_000_000:
        pytest.skip("2048 x 1000 runs on CUDA only: the float64 reference on the CPU is slow")
    batch, heads_q, heads_kv = (1, 2, 1) if backend.device == "cpu" else (2, 4, 2)
    backend.check_forward(Case(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=nq, seqlen_k=nk,
                               head_dim=head_dim, dtype=backend.primary_dtype, mask=mask, is_causal=is_causal))


@pytest.mark.parametrize("head_dim", [1, 2, 5, 31, 32, 64, 100, 128, 200, 256])
def test_head_dims(backend, head_dim):
    backend.check_forward(Case(head_dim=head_dim, seqlen_q=70, seqlen_k=300, dtype=backend.primary_dtype,
                               mask="bool"))


@pytest.mark.parametrize("heads", [(8, 1), (6, 2), (4, 4)], ids=["mqa", "gqa", "mha"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_query_heads(backend, heads, dtype):
    backend.check_forward(Case(heads_q=heads[0], heads_kv=heads[1], seqlen_q=300, seqlen_k=520, head_dim=64,
                               dtype=dtype, is_causal=True, mask="key_padding"))


def test_causal_is_bottom_right(backend):
    # Nq < Nk: the last query sees every key; Nq > Nk: the first Nq - Nk rows see nothing.
    for nq, nk in [(5, 300), (300, 5), (257, 256)]:
        _, lse = backend.check_forward(Case(seqlen_q=nq, seqlen_k=nk, head_dim=64, dtype=backend.primary_dtype,
                                            is_causal=True))
        assert lse.isinf().any() == (nq > nk)


@pytest.mark.parametrize("scale", [0.0, -0.7, 1e-39, 1e-4, 3.0])
@pytest.mark.parametrize("mask", ["none", "bool"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", FEATURE_HEAD_DIMS)
def test_any_finite_scale(backend, scale, mask, is_causal, head_dim):
    """A scale of 0 gives every visible key the same weight; a negative one
    favours the lowest scores; 1e-39 is a float32 denormal (the sm90 forward
    folds a scale of at least FLT_MIN into its exponent and refuses the rest).
    Hidden keys stay hidden whatever the scale."""
    backend.check_forward(Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=150, seqlen_k=333, head_dim=head_dim,
                               dtype=backend.primary_dtype, mask=mask, is_causal=is_causal, scale=scale))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_scale_does_not_overflow(backend, dtype):
    # Scores around 1e4: the online softmax must subtract the running max.
    backend.check_forward(Case(scale=300.0, seqlen_q=60, seqlen_k=600, head_dim=64, dtype=dtype, mask="additive"))


def test_all_keys_hidden_give_zero_and_minus_inf(backend):
    """Rows that see no key (a mask hiding them, or no keys at all): out 0, lse -inf."""
    backend.check_forward(Case(mask="fully_masked_rows", dtype=torch.float16, head_dim=128))
    case = Case(dtype=torch.float16, head_dim=128)
    q, k, v, _ = backend.inputs(case)
    hidden = torch.zeros(case.seqlen_q, case.seqlen_k, dtype=torch.bool, device=backend.device)
    out, lse = backend.forward(q, k, v, hidden, False, None)
    assert (out == 0).all() and (lse == float("-inf")).all()
    # No keys: nothing to describe with a tensor map, so the planner's family.
    out, lse = torch.ops.fusedattn.forward(q, k[:, :, :0], v[:, :, :0])
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_additive_mask_of_another_float_dtype(backend):
    case = Case(dtype=torch.bfloat16, head_dim=128, mask="additive")
    q, k, v, mask = backend.inputs(case)
    for mask_dtype in (torch.float32, torch.float64, torch.float16):
        out, lse = backend.forward(q, k, v, mask.to(mask_dtype), False, None)
        check_forward(case, device=backend.device, out=out, lse=lse)


def test_finfo_min_mask_counts_as_minus_inf(backend):
    """Documented rule: an additive value that overflows to -inf in base-2 units
    (float32's finfo.min) hides its key exactly like -inf does."""
    q, k, v, _ = backend.inputs(Case(dtype=torch.float16, head_dim=128))
    hidden = torch.rand(q.shape[2], k.shape[2], device=backend.device) < 0.3
    hidden[0] = True  # one row hidden entirely: out 0, lse -inf
    with_inf = torch.zeros(hidden.shape, device=backend.device).masked_fill(hidden, float("-inf"))
    with_min = torch.zeros(hidden.shape, device=backend.device).masked_fill(hidden, torch.finfo(torch.float32).min)
    out_inf, lse_inf = backend.forward(q, k, v, with_inf, False, None)
    out_min, lse_min = backend.forward(q, k, v, with_min, False, None)
    torch.testing.assert_close(out_min, out_inf, atol=0, rtol=0)
    torch.testing.assert_close(lse_min, lse_inf, atol=0, rtol=0)
    assert (out_min[:, :, 0] == 0).all() and (lse_min[:, :, 0] == float("-inf")).all()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_arbitrary_strides(backend, head_dim):
    """q in [B, N, H, d] memory, k rows 2d elements apart, v on rows off by one
    element (2 bytes at 16 bits: copied on CUDA) and v with its last dim strided."""
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=130, head_dim=head_dim,
                dtype=backend.primary_dtype, mask="bool")
    q, k, v, mask = backend.inputs(case)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_wide = torch.cat([k, torch.randn_like(k)], dim=-1)[..., :head_dim]
    v_off = torch.cat([torch.randn_like(v[..., :1]), v], dim=-1)[..., 1:]
    v_cols = v.transpose(-1, -2).contiguous().transpose(-1, -2)
    backend.require_plan(q_t, k_wide, v_cols, mask)  # sm90 takes attn_mask at d=128 only
    for v_strided in (v_off, v_cols):
        out, lse = backend.forward(q_t, k_wide, v_strided, mask, False, None)
        check_forward(case, device=backend.device, out=out, lse=lse)


def test_batch_broadcast_with_stride_0(backend):
    """k and v broadcast over the batch (stride 0) read the same rows for every
    batch entry; a tensor map takes no stride 0, so the planner gives them to sm80."""
    q, k, v, _ = backend.inputs(Case(batch=2, seqlen_q=77, seqlen_k=130, head_dim=64, dtype=backend.primary_dtype))
    k_b, v_b = k[:1].expand_as(k), v[:1].expand_as(v)
    if backend.name == "sm90":
        with fusedattn.backends.force("auto"):
            assert fusedattn.plan(q, k_b, v_b)["family"] == "sm80"
        return
    out, _ = backend.forward(q, k_b, v_b, None, False, None)
    out1, _ = backend.forward(q[1:], k[:1], v[:1], None, False, None)
    torch.testing.assert_close(out[1:], out1, atol=0, rtol=0)
