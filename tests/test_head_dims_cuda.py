"""Head dims the CUDA kernels have no instantiation for: any d up to the
largest served one (the forward's 256, the backward's 128, on sm90 256), and a value head
dim of its own (d_v != d). The operators pad q, k and v with zeros to the next
served head dim (the plan's head_dim) and cut the outputs back; forward and
backward on each family against the float64 reference, with masks, windows,
sinks and GQA, their fake functions, torch.compile, the gemm family above the
largest, and decoding at d=256. Odd head dims on every backend are also in
test_forward.py's and test_backward.py's test_head_dims."""

import pytest
import torch

import fusedattn
from fusedattn.ops import cuda_head_dims
from helpers.attention_cases import Case, check_backward, check_forward, make_inputs
from helpers.cuda import check_cuda, check_cuda_backward, served_head_dims, sm90_available
from helpers.kvcache_cases import check_against_reference

pytestmark = pytest.mark.gpu

# (d, d_v): below, between and at the served dims, d_v above and below d.
PADDED = [(8, 8), (40, 40), (80, 80), (96, 96), (100, 100), (64, 32), (40, 128), (128, 64), (16, 96), (1, 3),
          (160, 160), (192, 128), (256, 256), (129, 200)]


@pytest.mark.parametrize("d,d_v", PADDED, ids=str)
@pytest.mark.parametrize("call", ["none", "causal", "bool", "window"])
def test_forward_at_padded_head_dims(cuda_family, d, d_v, call):
    check_cuda(Case(seqlen_q=130, seqlen_k=257, head_dim=d, head_dim_v=d_v, dtype=torch.bfloat16,
                    mask="bool" if call == "bool" else "none", is_causal=call == "causal",
                    window=(40, 7) if call == "window" else None))


@pytest.mark.parametrize("d,d_v", [(40, 40), (80, 80), (96, 96), (64, 32), (40, 128), (128, 96)], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_backward_at_padded_head_dims(cuda_family, d, d_v, is_causal):
    check_cuda_backward(Case(heads_q=6, heads_kv=2, seqlen_q=190, seqlen_k=260, head_dim=d, head_dim_v=d_v,
                             dtype=torch.float16, is_causal=is_causal))


@pytest.mark.parametrize("d,d_v", [(80, 80), (48, 24)], ids=str)
def test_padded_head_dims_with_sinks_and_a_mask(cuda_family, d, d_v):
    case = Case(seqlen_q=77, seqlen_k=300, head_dim=d, head_dim_v=d_v, dtype=torch.bfloat16, mask="additive",
                sinks=True)
    check_cuda(case)
    check_cuda_backward(case)


def test_padded_plan_says_the_kernel_head_dim():
    """The plan names the dim the kernels run; a served dim is not padded."""
    for d, d_v, want in [(8, 8, 32), (33, 33, 64), (64, 64, 64), (64, 65, 128), (96, 80, 128), (128, 1, 128)]:
        q, k, v, _ = make_inputs(Case(head_dim=d, head_dim_v=d_v, dtype=torch.float16), "cuda")
        assert fusedattn.plan(q, k, v)["head_dim"] == want, (d, d_v)
        assert fusedattn.plan(q, k, v, backward=True)["head_dim"] == want, (d, d_v)
    q, k, v, _ = make_inputs(Case(head_dim=160, head_dim_v=128, dtype=torch.float16), "cuda")
    plan = fusedattn.plan(q, k, v)  # above 128 the forward's kernels run at 192 and 256 (sm90: 112-, 80-key tiles)
    assert plan["family"] == ("sm90" if sm90_available() else "sm80") and plan["head_dim"] == 192
    assert plan["block_n"] == (112 if sm90_available() else 64)
    plan = fusedattn.plan(q, k, v, backward=True)  # sm90's backward runs it at 192, sm80's has no kernel
    assert (plan["family"], plan["head_dim"]) == (("sm90", 192) if sm90_available() else ("gemm", 160))


def test_padding_keeps_the_scale_of_the_call():
    """The default scale is 1/sqrt(d) of the call's d, not of the padded one."""
    q, k, v, _ = make_inputs(Case(head_dim=40, dtype=torch.float32), "cuda")
    q, k, v = (t.half() for t in (q, k, v))
    out = fusedattn.attention(q, k, v)
    explicit = fusedattn.attention(q, k, v, scale=40 ** -0.5)
    torch.testing.assert_close(out, explicit, atol=0, rtol=0)
    wrong = fusedattn.attention(q, k, v, scale=64 ** -0.5)
    assert (out - wrong).abs().max() > 1e-2


def test_strided_inputs_at_a_padded_head_dim():
    """q, k, v as views of [B, N, H, d] (FlashAttention's layout) and an output that is a fresh tensor."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 150, 4, 80, generator=g).half().cuda().transpose(1, 2) for _ in range(3))
    out = fusedattn.attention(q, k, v, is_causal=True)
    assert out.shape == (2, 4, 150, 80) and out.is_contiguous()
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)


def test_fake_functions_and_compile_at_a_padded_head_dim():
    q, k, v, _ = make_inputs(Case(head_dim=80, head_dim_v=48, dtype=torch.bfloat16), "cuda")
    torch.library.opcheck(torch.ops.fusedattn.forward.default, (q, k, v, None, True))
    out, lse = torch.ops.fusedattn.forward(q, k, v, None, True)
    torch.library.opcheck(torch.ops.fusedattn.backward.default, (torch.randn_like(out), q, k, v, out, lse, None,
                                                                 True))
    torch._dynamo.reset()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(fusedattn.attention, fullgraph=True)
    got = compiled(*leaves, is_causal=True)
    torch.testing.assert_close(got, fusedattn.attention(q, k, v, is_causal=True), atol=0, rtol=0)
    got.float().sum().backward()
    assert [t.grad.shape for t in leaves] == [t.shape for t in (q, k, v)]


def test_head_dims_above_the_largest_run_on_the_gemm_family():
    """Above 256 the forward, above 128 (sm90: 256) the backward runs on the
    gemm family (float32 matrix products); supports(fused=True) says where the
    kernels stop."""
    top, top_backward = cuda_head_dims("sm80_forward")[-1], served_head_dims(backward=True)[-1]
    for d, d_v in [(top + 1, top), (top, top + 32)]:
        case = Case(head_dim=d, head_dim_v=d_v, dtype=torch.float16, seqlen_q=70, seqlen_k=90)
        q, k, v, _ = make_inputs(case, "cuda")
        assert fusedattn.plan(q, k, v)["family"] == "gemm"
        check_forward(case, "cuda")
        assert not fusedattn.ops.supports(q.device, q.dtype, d, d_v, backward=False, fused=True)
        assert fusedattn.ops.supports(q.device, q.dtype, d, d_v, backward=False)
    case = Case(head_dim=top_backward + 8, dtype=torch.float16, seqlen_q=70, seqlen_k=90, is_causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    assert fusedattn.plan(q, k, v)["family"] == ("gemm" if top_backward == top else "sm80")
    assert fusedattn.plan(q, k, v, backward=True)["family"] == "gemm"
    check_backward(case, "cuda")
    assert fusedattn.ops.supports(q.device, q.dtype, top, backward=False, fused=True)
    assert not fusedattn.ops.supports(q.device, q.dtype, top_backward + 8, fused=True)
    assert fusedattn.ops.supports(q.device, q.dtype, 80, 48, fused=True)


@pytest.mark.parametrize("splits", [None, 1, 5])
def test_decode_at_head_dim_256(splits):
    """Gemma 3's head dim: the decode kernel's own instantiation (4 warps), its split merge over 256 columns."""
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, capacity, d = 3, 8, 2, 900, 256
    k_cache, v_cache = (torch.randn(B, Hkv, capacity, d, generator=g).half().cuda() for _ in range(2))
    lengths = torch.tensor([0, 517, 880], dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, 1, d, generator=g).half().cuda()
    k_new, v_new = (torch.randn(B, Hkv, 1, d, generator=g).half().cuda() for _ in range(2))
    plan = fusedattn.plan_kvcache(q, k_cache, v_cache, num_splits=splits)
    assert plan["family"] == "decode" and plan["head_dim"] == 256 and plan["warps"] == 4
    assert splits is None or plan["num_splits"] == splits
    out, lse = torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, lengths, k_new, v_new, True,
                                                   num_splits=splits)
    check_against_reference(q, k_cache, v_cache, lengths, k_new, v_new, True, out, lse)


def test_decode_takes_served_head_dims_only():
    """The decode kernel appends into the caches in place, so it cannot pad a
    copy of them: other head dims run on the gemm family (tests/test_gemm_family.py)."""
    q = torch.randn(1, 4, 1, 80, device="cuda", dtype=torch.float16)
    cache = torch.zeros(1, 4, 64, 80, device="cuda", dtype=torch.float16)
    assert fusedattn.plan_kvcache(q, cache, cache.clone())["family"] == "gemm"
    assert fusedattn.plan_kvcache(q[..., :64], cache[..., :64], cache[..., :64].clone())["family"] == "decode"
