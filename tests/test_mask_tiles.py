"""attn_mask sorted into tiles on CUDA (cpp/cuda/common/mask_tiles.h): masks
whose hidden and whole tiles the sm90 forward skips or reads nothing of, at
lengths that span many tiles, per family, forward and backward, against the
float64 reference (marker `gpu`)."""

import pytest
import torch

import fusedattn
from helpers.attention_cases import TILE_MASK_KINDS, Case, check_backward, make_inputs
from helpers.cuda import check_cuda, check_cuda_backward, forward, sm90_available

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mask", TILE_MASK_KINDS)
@pytest.mark.parametrize("nq,nk", [(1000, 1000), (700, 2100), (2100, 700), (1024, 2048)])
@pytest.mark.parametrize("band", [{}, {"is_causal": True}, {"window": (300, 40)}], ids=["full", "causal", "window"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_tile_masks(cuda_family, mask, nq, nk, band, head_dim):
    """Tiles hidden, whole and partly visible, with causal and windows (whose tiles the
    lists leave out too), Nq != Nk, rows that see nothing; sm90's query tiles are 192
    rows at d=64, 128 at d=128."""
    case = Case(batch=4, heads_q=4, heads_kv=2, seqlen_q=nq, seqlen_k=nk, head_dim=head_dim, dtype=torch.bfloat16,
                mask=mask, **band)
    check_cuda(case)


@pytest.mark.parametrize("mask", ["key_lengths", "documents", "sparse_tiles", "hidden_query_tiles"])
@pytest.mark.parametrize("nq,nk,band", [(900, 1100, {"is_causal": True}), (1100, 700, {}),
                                        (800, 800, {"window": (200, 30)})], ids=["causal", "full", "window"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_tile_masks_backward(cuda_family, mask, nq, nk, band, head_dim):
    """The backward walks each key block's list of query blocks (per query head where the
    mask is: sparse_tiles and hidden_query_tiles, whose heads share a kv head)."""
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=nq, seqlen_k=nk, head_dim=head_dim, dtype=torch.float16,
                mask=mask, **band)
    check_cuda_backward(case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_tile_masks_float_kinds(cuda_family, dtype):
    """An additive mask of the input's dtype and one of float32: tiles all -inf are
    skipped, tiles all 0 read nothing, whichever kind holds them."""
    case = Case(batch=2, heads_q=4, heads_kv=4, seqlen_q=800, seqlen_k=1300, head_dim=128, dtype=dtype,
                mask="sparse_tiles")
    check_cuda(case)
    q, k, v, mask = make_inputs(case, "cuda")
    out32, _ = forward(q, k, v, mask.float())
    out, _ = forward(q, k, v, mask)
    torch.testing.assert_close(out32, out, atol=2e-2, rtol=0)


def test_cuda_mask_tiles_plan():
    """Every CUDA forward and backward sorts a mask into its tiles first (the backward by
    key tiles); unmasked calls do not."""
    if not sm90_available():
        pytest.skip("this build or GPU has no sm90 kernels")
    q, k, v, mask = make_inputs(Case(seqlen_q=300, seqlen_k=300, head_dim=128, dtype=torch.bfloat16,
                                     mask="key_lengths"), "cuda")
    assert fusedattn.plan(q, k, v, mask)["mask_tiles"] is True
    assert fusedattn.plan(q, k, v)["mask_tiles"] is False
    backward = fusedattn.plan(q, k, v, mask, backward=True)
    assert (backward["family"], backward["mask_tiles"]) == ("sm90", True), backward
    assert fusedattn.plan(q, k, v, backward=True)["mask_tiles"] is False
    with fusedattn.backends.force("sm80"):
        assert fusedattn.plan(q, k, v, mask)["mask_tiles"] is True
        assert fusedattn.plan(q, k, v, mask, backward=True)["mask_tiles"] is True


@pytest.mark.parametrize("mask", ["sparse_tiles", "hidden_query_tiles"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_tile_masks_backward_heads_of_a_group(cuda_family, mask, head_dim):
    """Enough key blocks that a block walks all four query heads of its kv head (no head
    splits), each head with a mask, so with a list, of its own."""
    case = Case(batch=4, heads_q=32, heads_kv=8, seqlen_q=2048, seqlen_k=2048, head_dim=head_dim,
                dtype=torch.bfloat16, mask=mask, is_causal=True)
    q, k, v, m = make_inputs(case, "cuda")
    assert fusedattn.plan(q, k, v, m, True, backward=True)["head_splits"] == 1
    check_cuda_backward(case)


def test_cuda_tile_masks_backward_without_queries(cuda_family):
    """No queries under a key padding mask: the key blocks still write dK = dV = 0, over
    empty lists."""
    q, k, v, mask = make_inputs(Case(batch=2, seqlen_q=1, seqlen_k=700, head_dim=128, dtype=torch.float16,
                                     mask="key_lengths"), "cuda", requires_grad=True)
    dq, dk, dv = torch.autograd.grad(fusedattn.attention(q[:, :, :0], k, v, mask).sum(), (q, k, v))
    assert (dk == 0).all() and (dv == 0).all() and dq.shape == q.shape


@pytest.mark.parametrize("mask", ["sparse_tiles", "hidden_query_tiles", "documents"])
@pytest.mark.parametrize("nq,nk", [(1024, 1536), (1040, 1000)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_tile_masks_stored_by_keys(cuda_family, mask, nq, nk, head_dim):
    """A mask stored key-major (row stride 1: a transposed tensor's view) sorts into the
    same tiles: the forward's sort reads it in vectors along the queries, the backward's
    along the keys. out equals the one under the same mask stored query-major; the
    gradients (some summed with atomics, in no fixed order) match within bf16 rounding."""
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=nq, seqlen_k=nk, head_dim=head_dim, dtype=torch.bfloat16,
                mask=mask, is_causal=True)
    q, k, v, by_queries = make_inputs(case, "cuda", requires_grad=True)
    by_keys = by_queries.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert by_keys.stride(-2) == 1 and torch.equal(by_keys, by_queries)
    grad = torch.randn_like(q)
    results = []
    for m in (by_queries, by_keys):
        out = fusedattn.attention(q, k, v, m, True)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    (out, dq, dk, dv), (out2, dq2, dk2, dv2) = results
    assert torch.equal(out, out2)
    for a, b in ((dq, dq2), (dk, dk2), (dv, dv2)):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_tile_masks_backward_float32_mask(cuda_family, head_dim):
    """A float32 additive mask through the backward: its tiles that read the mask stage
    4-byte entries (in several rounds of the sm90 backward's per-warp stage)."""
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=700, seqlen_k=900, head_dim=head_dim,
                dtype=torch.bfloat16, mask="sparse_tiles", is_causal=True)
    q, k, v, mask = make_inputs(case, "cuda", requires_grad=True)
    grad_out = torch.randn_like(q)
    out = fusedattn.attention(q, k, v, mask.float(), True)
    assert fusedattn.plan(q, k, v, mask.float(), True, backward=True)["mask_tiles"] is True
    # The reference takes the bf16 mask, whose values float32 holds exactly.
    check_backward(case, "cuda", grads=torch.autograd.grad(out, (q, k, v), grad_out), grad_out=grad_out)
