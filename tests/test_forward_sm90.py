"""What only the sm90 forward has (marker `gpu`; the family forced, skipped
where the build or GPU lacks it): persistent blocks, 176-key tiles, d=192 and
256 in 112- and 80-key tiles, soft-capping, its refusals. The features every family serves are tested per family in
test_forward.py."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fusedattn
from helpers.attention_cases import Case, cases, check_forward, make_inputs, make_sinks
from helpers.cuda import GPU_DTYPES, check_cuda, forward

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("sm90")]


def plan_of(case: Case) -> dict:
    """The case's plan, with every option the call passes."""
    q, k, v, mask = make_inputs(case, "cuda")
    return fusedattn.plan(q, k, v, mask, case.is_causal, case.scale, window=case.window, softcap=case.softcap,
                          sinks=make_sinks(case, "cuda"))


@pytest.mark.parametrize("nq,nk", [(1000, 1000), (2000, 700)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim,mask", [(64, "none"), (128, "none"), (64, "bool"), (128, "bool")])
def test_sm90_blocks_take_many_items(nq, nk, is_causal, head_dim, mask):
    """More query blocks than SMs (3 x 12 heads x 6-16 blocks), so at d=128, and at d=64 under
    causal, every persistent block takes several work items; under causal with Nq > Nk the
    first query blocks of each head see no key, and their zero rows sit among the others. Two
    calls in a row: each starts its own count of the items handed out."""
    case = Case(batch=3, heads_q=12, heads_kv=4, seqlen_q=nq, seqlen_k=nk, head_dim=head_dim,
                dtype=torch.bfloat16, is_causal=is_causal, mask=mask)
    assert plan_of(case)["persistent"] == (head_dim == 128 or is_causal)
    check_cuda(case)
    check_cuda(case)


@pytest.mark.parametrize("batch,heads_q,heads_kv,nq,nk", [(1, 2, 1, 1000, 16500), (1, 2, 1, 2100, 16384),
                                                         (2, 36, 4, 300, 16500)])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_sm90_causal_wide_tiles(batch, heads_q, heads_kv, nq, nk, dtype):
    """Causal calls from 16K keys take 176-key tiles at d=128 (tile_size.h): the diagonal
    inside a wide tile, and (16500 = 93 x 176 + 132) a last tile only partly filled; the last
    case has 216 query blocks, so the persistent blocks take several each."""
    case = Case(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=nq, seqlen_k=nk, head_dim=128,
                dtype=dtype, is_causal=True)
    assert plan_of(case)["block_n"] == 176
    assert plan_of(dataclasses.replace(case, seqlen_k=16383, seqlen_q=min(nq, 16383)))["block_n"] == 128
    check_cuda(case)


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("call", ["none", "causal", "window", "sinks", "dv128", "padded"])
@pytest.mark.parametrize("head_dim,block_n", [(192, 112), (256, 80)])
def test_sm90_wide_head_dims(dtype, call, head_dim, block_n):
    """d=192 and 256 (DeepSeek's prefill, Gemma 2/3) in 112- and 80-key tiles
    (tile_size.h): 517 keys end inside a tile; 2 x 36 heads x 3-6 query blocks
    are more items than SMs, so the persistent blocks take several; under
    causal Nq - Nk = 183 rows see no key, the first query block of each head
    among them. "dv128": v's head dim 128 (DeepSeek's 192/128) runs padded to
    d; "padded": d - 32 runs padded to d."""
    d = head_dim - 32 if call == "padded" else head_dim
    case = Case(batch=2, heads_q=36, heads_kv=4, seqlen_q=700 if call == "causal" else 300, seqlen_k=517,
                head_dim=d, head_dim_v=128 if call == "dv128" else None, dtype=dtype, is_causal=call == "causal",
                window=(100, 20) if call == "window" else None, sinks=call == "sinks")
    plan = plan_of(case)
    assert (plan["family"], plan["block_n"], plan["persistent"], plan["head_dim"]) == ("sm90", block_n, True,
                                                                                      head_dim)
    check_cuda(case)


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", fusedattn.ops.cuda_head_dims("sm90_forward_capped") or [128])
@pytest.mark.parametrize("call", ["none", "causal", "window", "sinks", "gqa"])
@pytest.mark.parametrize("softcap", [5.0, 0.3], ids=str)
def test_sm90_soft_caps(dtype, head_dim, call, softcap):
    """Soft-capping in its own sm90 kernels (before the band hides anything,
    so hidden keys stay hidden): a cap the scores rarely reach and one that
    flattens most of them; 517 keys end inside a tile."""
    case = Case(batch=2, heads_q=8, heads_kv=2 if call == "gqa" else 8, seqlen_q=300, seqlen_k=517,
                head_dim=head_dim, dtype=dtype, is_causal=call == "causal",
                window=(100, 20) if call == "window" else None, sinks=call == "sinks", softcap=softcap)
    plan = plan_of(case)
    assert plan["family"] == "sm90" and plan["head_dim"] == head_dim, plan
    check_cuda(case)


def test_sm90_soft_caps_in_wide_causal_tiles():
    """Causal from 16K keys at d=128: the capped kernel of 176-key tiles, the diagonal inside them."""
    case = Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=1000, seqlen_k=16500, head_dim=128, dtype=torch.float16,
                is_causal=True, softcap=30.0)
    plan = plan_of(case)
    assert (plan["family"], plan["block_n"]) == ("sm90", 176), plan
    check_cuda(case)


def test_sm90_agrees_with_sm80():
    case = Case(batch=2, heads_q=8, heads_kv=2, seqlen_q=300, seqlen_k=517, head_dim=128,
                dtype=torch.float16, is_causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    out90, lse90 = forward(q, k, v, None, True, None)
    with fusedattn.backends.force("sm80"):
        assert fusedattn.plan(q, k, v, None, True)["family"] == "sm80"
        out80, lse80 = forward(q, k, v, None, True, None)
    torch.testing.assert_close(out90, out80, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse90, lse80, atol=1e-4, rtol=1e-5)
    check_forward(case, device="cuda", out=out90, lse=lse90)


@given(cases(max_len=700), st.sampled_from(GPU_DTYPES), st.sampled_from([64, 128]))
def test_sm90_random_cases(case, dtype, head_dim):
    """The random cases, every mask kind among them, at the sm90 forward's head dims."""
    check_cuda(dataclasses.replace(case, dtype=dtype, head_dim=head_dim))


def test_sm90_refuses_what_it_cannot_take():
    q, k, v, _ = make_inputs(Case(dtype=torch.float16, head_dim=32), "cuda")
    dims = ", ".join(map(str, fusedattn.ops.cuda_head_dims("sm90_forward")))
    with pytest.raises(RuntimeError, match=rf"family sm90 was forced, but the sm90 forward has head dims \[{dims}\], "
                       "got 32"):
        forward(q, k, v)
    capped = ", ".join(map(str, fusedattn.ops.cuda_head_dims("sm90_forward_capped")))
    with pytest.raises(RuntimeError, match=rf"the sm90 forward soft-caps at head dims \[{capped}\], got 64"):
        fusedattn.plan(*make_inputs(Case(dtype=torch.float16, head_dim=64), "cuda")[:3], softcap=5.0)
    q, k, v, _ = make_inputs(Case(dtype=torch.float16, head_dim=128), "cuda")
    mask = torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool, device="cuda")
    with pytest.raises(RuntimeError, match="the sm90 forward soft-caps calls without attn_mask only"):
        torch.ops.fusedattn.forward(q, k, v, mask, False, None, "sm90", None, 5.0)
    for scale in (-0.5, 1e-39):  # negative; below FLT_MIN (flushed to 0 by the kernels' fast math)
        with pytest.raises(RuntimeError, match="the sm90 forward takes a scale of at least FLT_MIN"):
            forward(q, k, v, None, False, scale)
        with pytest.raises(RuntimeError, match="the sm90 forward takes a scale of at least FLT_MIN"):
            forward(q, k, v, torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool, device="cuda"), False, scale)
        with pytest.raises(RuntimeError, match="FLT_MIN"):
            fusedattn.plan(q, k, v, None, False, scale)


def test_sm90_strided_operands():
    """Strides the tensor maps take: q in [B, N, H, d] memory, k rows 128 elements apart."""
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=200, seqlen_k=333, head_dim=64,
                dtype=torch.bfloat16, is_causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_wide = torch.cat([k, torch.randn_like(k)], dim=-1)[..., :64]
    assert fusedattn.plan(q_t, k_wide, v, None, True)["family"] == "sm90"
    out, lse = forward(q_t, k_wide, v, None, True, None)
    check_forward(case, device="cuda", out=out, lse=lse)


def test_sm90_declines_what_tensor_maps_cannot_describe():
    """k and v broadcast over heads (stride 0): the planner gives the call to
    sm80 unless sm90 is forced, which is an error that says why."""
    q = torch.randn(2, 4, 150, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 1, 150, 128, device="cuda", dtype=torch.float16).expand(2, 4, 150, 128)
    v = torch.randn(2, 1, 150, 128, device="cuda", dtype=torch.float16).expand(2, 4, 150, 128)
    with pytest.raises(RuntimeError, match="tensor memory accelerator cannot describe k: its byte strides"):
        forward(q, k, v, None, False, None)
    with fusedattn.backends.force("auto"):
        assert fusedattn.plan(q, k, v)["family"] == "sm80"
        out, _ = forward(q, k, v, None, False, None)
    ref = fusedattn.reference.attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)
