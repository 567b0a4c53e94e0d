"""Soft-capping (scores -> softcap * tanh(scores / softcap) after scaling,
before masks) and attention sinks (one value-less logit per query head in
every row's softmax), forward and backward, dense, varlen and KV cache,
against the float64 reference; on CUDA, sinks in every kernel family and
both split merges of the decode kernels, soft-capping in the CUDA forwards and
backwards."""

import pytest
import torch
from hypothesis import given

import fusedattn
from fusedattn import reference
from helpers.attention_cases import Case, assert_within_rule, cases, check_backward, check_forward
from helpers.cuda import GPU_DTYPES
from helpers.kvcache_cases import check_against_reference, make_cache
from helpers.varlen_cases import check_varlen, packed, sequence

# None; a cap the scores rarely reach; one that flattens most of them.
SOFTCAPS = [None, 5.0, 0.3]


@pytest.mark.parametrize("softcap", SOFTCAPS, ids=str)
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("mask", ["none", "bool", "additive", "fully_masked_rows", "key_padding"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_forward(backend, softcap, sinks, mask, is_causal):
    """Every mask kind the rows' sink must survive: rows that see no key give
    out 0 and lse = the sink (lse -inf without one)."""
    backend.check_forward(Case(seqlen_q=140, seqlen_k=300, head_dim=64, dtype=backend.primary_dtype, mask=mask,
                               is_causal=is_causal, softcap=softcap, sinks=sinks))


@pytest.mark.parametrize("softcap", SOFTCAPS, ids=str)
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("mask", ["none", "fully_masked_rows", "additive"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_backward(backend, softcap, sinks, mask, is_causal):
    """dq, dk, dv and the sinks' gradient (summed over batch and queries)."""
    backend.check_backward(Case(seqlen_q=140, seqlen_k=300, head_dim=64, dtype=backend.primary_dtype, mask=mask,
                                is_causal=is_causal, softcap=softcap, sinks=sinks))


@pytest.mark.parametrize("dtype", [torch.float32, *GPU_DTYPES], ids=str)
@pytest.mark.parametrize("heads", [(6, 2), (4, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("window", [None, (20, 0), (7, 30)], ids=str)
def test_dtypes_groups_and_windows(backend, dtype, heads, window):
    for sinks in (False, True):
        case = Case(heads_q=heads[0], heads_kv=heads[1], seqlen_q=97, seqlen_k=260, head_dim=64, dtype=dtype,
                    window=window, softcap=2.0, sinks=sinks)
        backend.check_forward(case)
        backend.check_backward(case)


@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("size", [(1, 1), (1, 700), (700, 1), (257, 129)], ids=str)
def test_sizes_and_head_dims(backend, head_dim, size):
    case = Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=size[0], seqlen_k=size[1], head_dim=head_dim,
                dtype=backend.primary_dtype, is_causal=True, sinks=True)
    backend.check_forward(case)
    backend.check_backward(case)


@given(cases(max_len=200, with_softcap_and_sinks=True))
def test_random_cases_cpu(case):
    check_forward(case)


@given(cases(max_len=120, with_softcap_and_sinks=True))
def test_random_cases_cpu_backward(case):
    check_backward(case)


def test_a_row_that_sees_nothing_puts_all_its_weight_on_the_sink():
    """out 0 and lse = the sink exactly (not -inf): the sink is the only term."""
    q, k, v = (torch.randn(1, 3, 5, 16) for _ in range(3))
    mask = torch.ones(1, 3, 5, 5, dtype=torch.bool)
    mask[:, :, 2] = False
    sinks = torch.tensor([0.5, -3.0, 7.0])
    out, lse = torch.ops.fusedattn.forward(q, k, v, mask, sinks=sinks)
    assert torch.equal(out[:, :, 2], torch.zeros(1, 3, 16))
    assert torch.equal(lse[0, :, 2], sinks)


def test_softcap_bounds_every_score():
    """With a cap c the scores lie in (-c, c), so a huge q spreads its weight
    over the keys instead of picking one: the output is the reference's,
    which without the cap would be one key's value."""
    q, k, v = torch.randn(1, 1, 4, 16) * 100, torch.randn(1, 1, 64, 16), torch.randn(1, 1, 64, 16)
    out, lse = torch.ops.fusedattn.forward(q, k, v, softcap=1.0)
    oracle, oracle_lse = reference.attention_with_lse(q.double(), k.double(), v.double(), softcap=1.0)
    torch.testing.assert_close(out.double(), oracle, atol=1e-5, rtol=0)
    assert (lse <= 1.0 + torch.log(torch.tensor(64.0))).all()
    uncapped, _ = torch.ops.fusedattn.forward(q, k, v)
    assert (out - uncapped).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_softcap_across_tanh_range(dtype):
    """The CPU's tanh has two forms (a polynomial up to |score / cap| = 1, an
    exponential beyond, on whole rows within the cap the polynomial alone):
    rows of scores from 1e-5 of the cap to 1e4 times it (past tanh's
    saturation and the exponential's clamp), both signs, straddling the seam,
    are as accurate as float32's torch.tanh through the reference, with
    gradients; a NaN key score stays NaN in every row, the polynomial's rows
    and the exponential's."""
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 90, 16, generator=gen), torch.randn(1, 2, 90, 16, generator=gen)
    # Row r's scaled scores are about spread[r] (q.k over 16 dims is about 4 spread, then the scale
    # 1/4): |score / cap| from about 1e-5 to 1e4 for a cap of 16.
    spread = torch.logspace(-4, 5, 57).view(1, 1, 57, 1)
    q, k, v = (t.to(dtype) for t in (torch.randn(1, 2, 57, 16, generator=gen) * spread, k, v))
    out, lse = torch.ops.fusedattn.forward(q, k, v, softcap=16.0)
    oracle, oracle_lse = reference.attention_with_lse(q.double(), k.double(), v.double(), softcap=16.0)
    low, _ = reference.attention_with_lse(q, k, v, softcap=16.0)
    assert_within_rule("out", out, oracle, low, dtype, factor=2)
    assert (lse.double() - oracle_lse).abs().max() <= 1e-4 * (1 + oracle_lse.abs().max())
    grad_out = torch.randn(out.shape, generator=gen).to(dtype)
    grads = {}
    for name, attend, cast in (("ours", fusedattn.attention, lambda t: t), ("oracle", reference.attention, torch.Tensor.double),
                               ("low", reference.attention, lambda t: t)):
        inputs = [cast(t).detach().requires_grad_() for t in (q, k, v)]
        grads[name] = torch.autograd.grad(attend(*inputs, softcap=16.0), inputs, cast(grad_out))
    magnitude = max(1.0, *(o.abs().max().item() for o in grads["oracle"]))
    for name, a, o, lp in zip(("dq", "dk", "dv"), grads["ours"], grads["oracle"], grads["low"]):
        assert_within_rule(name, a, o, lp, dtype, factor=3, scale=magnitude)
    k = k.clone()
    k[0, 1, 7, 3] = float("nan")
    out, _ = torch.ops.fusedattn.forward(q, k, v, softcap=16.0)
    assert out[0, 1].isnan().all() and not out[0, 0].isnan().any()


# varlen: empty sequences on either side, one token, Nq != Nk both ways.
LENGTHS = ([5, 0, 1, 40, 3, 17], [5, 9, 1, 33, 0, 70])


@pytest.mark.parametrize("softcap", SOFTCAPS, ids=str)
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_varlen(softcap, with_sinks, is_causal):
    sinks = torch.tensor([1.0, -0.5, 2.5, 0.0]) if with_sinks else None
    check_varlen(*LENGTHS, is_causal=is_causal, softcap=softcap, sinks=sinks)
    check_varlen(*LENGTHS, is_causal=is_causal, softcap=softcap, sinks=sinks, dtype=torch.bfloat16, window=(4, 2))


def test_varlen_gradients():
    lengths_q, lengths_k = [6, 0, 19, 1, 4], [6, 5, 11, 0, 30]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, requires_grad=True, seed=3)
    sinks = torch.tensor([1.0, -0.5, 2.5, 0.0], requires_grad=True)
    out = fusedattn.attention_varlen(q, k, v, cu_q, cu_k, is_causal=True, softcap=1.5, sinks=sinks)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    q64, k64, v64, sinks64 = inputs64
    outs = [reference.attention(sequence(q64, cu_q, b), sequence(k64, cu_k, b), sequence(v64, cu_k, b),
                                is_causal=True, softcap=1.5, sinks=sinks64)[0].transpose(0, 1)
            for b in range(len(lengths_q))]
    oracle = torch.autograd.grad(torch.cat(outs), inputs64, grad_out.double())
    for name, a, o in zip(("dq", "dk", "dv", "dsinks"), grads, oracle):
        torch.testing.assert_close(a.double(), o, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("softcap", [None, 0.7], ids=str)
def test_kvcache_cpu(softcap):
    q, k_cache, v_cache, lens, k_new, v_new = make_cache(B=3, Hq=4, Hkv=2, d=32, max_len=300, nq=3, n_new=3)
    sinks = torch.tensor([0.3, -1.0, 4.0, 1.5])
    out, lse = torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, lens, k_new, v_new, True, softcap=softcap,
                                                   sinks=sinks)
    check_against_reference(q, k_cache, v_cache, lens, k_new, v_new, True, out, lse, softcap=softcap, sinks=sinks)


def test_opcheck_and_compile():
    q, k, v = (torch.randn(2, 4, 9, 16) for _ in range(3))
    sinks = torch.randn(4)
    args = (q, k, v, None, True, None, None, None, 2.0, sinks)
    torch.library.opcheck(torch.ops.fusedattn.forward.default, args)
    out, lse = torch.ops.fusedattn.forward(*args)
    torch.library.opcheck(torch.ops.fusedattn.backward.default,
                          (torch.randn_like(out), q, k, v, out, lse, None, True, None, None, None, 2.0, sinks))
    qv, kv, vv, cu_q, cu_k = packed([4, 0, 9], [6, 3, 9], seed=6)
    torch.library.opcheck(torch.ops.fusedattn.forward_varlen.default,
                          (qv, kv, vv, cu_q, cu_k, 9, 9, True, None, None, None, 2.0, sinks))
    outv, lsev = torch.ops.fusedattn.forward_varlen(qv, kv, vv, cu_q, cu_k, 9, 9, True, None, None, None, 2.0, sinks)
    torch.library.opcheck(torch.ops.fusedattn.backward_varlen.default,
                          (torch.randn_like(outv), qv, kv, vv, outv, lsev, cu_q, cu_k, 9, 9, True, None, None, None,
                           2.0, sinks))

    torch._dynamo.reset()
    compiled = torch.compile(fusedattn.attention, fullgraph=True)
    q, sinks = q.requires_grad_(), sinks.requires_grad_()
    out = compiled(q, k, v, is_causal=True, softcap=2.0, sinks=sinks)
    torch.testing.assert_close(out, fusedattn.attention(q, k, v, is_causal=True, softcap=2.0, sinks=sinks))
    out.sum().backward()
    assert sinks.grad is not None and sinks.grad.shape == (4,) and sinks.grad.abs().sum() > 0


def test_the_plan_takes_them():
    q = torch.randn(1, 4, 8, 16)
    assert fusedattn.plan(q, q, q, softcap=3.0, sinks=torch.zeros(4), backward=True)["family"] == "cpu"


BAD = {
    "softcap 0": ({"softcap": 0.0}, "softcap must be None or a finite number > 0 .*got 0"),
    "softcap < 0": ({"softcap": -1.0}, "softcap must be None or a finite number > 0 .*got -1"),
    "softcap nan": ({"softcap": float("nan")}, "softcap must be None or a finite number > 0 .*got nan"),
    "softcap inf": ({"softcap": float("inf")}, "softcap must be None or a finite number > 0 .*got inf"),
    "softcap below FLT_MIN": ({"softcap": 1e-39}, "softcap must be None or a finite number > 0 .*got 1e-39"),
    "sinks [Hkv]": ({"sinks": torch.zeros(2)}, "sinks must be a 1-D tensor .* \\[Hq\\] = \\[4\\], got shape \\[2\\]"),
    "sinks 2-D": ({"sinks": torch.zeros(1, 4)}, "sinks must be a 1-D tensor .* got shape \\[1, 4\\]"),
    "sinks bf16": ({"sinks": torch.zeros(4, dtype=torch.bfloat16)}, "sinks must be float32, got BFloat16"),
}


@pytest.mark.parametrize("bad", BAD.values(), ids=BAD.keys())
def test_bad_input_says_what_was_expected(bad):
    options, message = bad
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match=message):
        fusedattn.attention(q, k, k, **options)
    qv, kv, _, cu_q, cu_k = packed([3, 5], [4, 4])
    with pytest.raises(RuntimeError, match=message):
        fusedattn.attention_varlen(qv, kv, kv, cu_q, cu_k, **options)
    q, k_cache, v_cache, lens, _, _ = make_cache(B=1, Hq=4, Hkv=2, d=16, max_len=20, n_new=0)
    with pytest.raises(RuntimeError, match=message):
        fusedattn.attention_with_kvcache(q, k_cache, v_cache, lens, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [0.3, 5.0, 50.0], ids=str)
@pytest.mark.parametrize("head_dim", [32, 40, 64, 128])
@pytest.mark.parametrize("mask", ["none", "additive"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_cuda_backward_soft_caps(cuda_family, softcap, head_dim, mask, is_causal):
    """Every family and backward head dim (padded too), with sinks, banded and
    not; sm90's backward soft-caps without attn_mask at 64 and 128 (forced
    with a mask, or at d=32, it raises; at d=40 and 64, where sm90's forward
    has no capped kernel, the forced backward runs after an unforced forward:
    helpers.cuda.check_cuda_backward)."""
    from helpers.cuda import check_cuda_backward

    for dtype in GPU_DTYPES:
        check_cuda_backward(Case(seqlen_q=150, seqlen_k=333, head_dim=head_dim, dtype=dtype, mask=mask,
                                 is_causal=is_causal, softcap=softcap, sinks=True))


@pytest.mark.gpu
def test_cuda_backward_soft_caps_in_the_fused_kernels():
    """The soft-capped backward's plan is a fused family's, sm90's where it
    takes the call unmasked; attn_mask sends it to sm80, which says so when
    sm90 is forced."""
    from helpers.cuda import sm90_available

    q = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.float16)
    m = torch.zeros(64, 64, device="cuda", dtype=torch.float16)
    with fusedattn.backends.force("auto"):
        assert fusedattn.plan(q, q, q, softcap=30.0, backward=True)["family"] == (
            "sm90" if sm90_available() else "sm80")
        assert fusedattn.plan(q, q, q, m, softcap=30.0, backward=True)["family"] == "sm80"
    if sm90_available():
        with fusedattn.backends.force("sm90"), pytest.raises(RuntimeError, match="soft-caps calls without attn_mask"):
            fusedattn.plan(q, q, q, m, softcap=30.0, backward=True)
    with pytest.raises(RuntimeError, match="sinks must be on cuda"):
        fusedattn.attention(q, q, q, sinks=torch.zeros(4))


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [0.3, 5.0, 50.0], ids=str)
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
def test_cuda_forward_soft_caps(cuda_family, softcap, head_dim):
    """Every family and head dim (padded ones too), causal with sinks and an additive mask."""
    from helpers.cuda import check_cuda

    check_cuda(Case(seqlen_q=150, seqlen_k=333, head_dim=head_dim, dtype=torch.bfloat16, mask="additive",
                    is_causal=True, softcap=softcap, sinks=True))


@pytest.mark.gpu
def test_cuda_soft_capping_plans_sm80():
    """sm90's forward refuses soft-capping at d=64 by name (forcing it raises); sm80's serves it."""
    q = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.float16)
    assert fusedattn.plan(q, q, q, softcap=30.0)["family"] == "sm80"
    if fusedattn.plan(q, q, q)["family"] == "sm90":
        with fusedattn.backends.force("sm90"), pytest.raises(RuntimeError, match="soft-caps at head dims"):
            fusedattn.attention(q, q, q, softcap=30.0)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4, None])
def test_cuda_decode_soft_caps(splits):
    q, k_cache, v_cache, lens, k_new, v_new = (t.cuda() for t in make_cache(B=3, Hq=8, Hkv=2, d=128, max_len=900,
                                                                           nq=2, n_new=2, dtype=torch.float16,
                                                                           seed=5))
    out, lse = torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, lens, k_new, v_new, True, None, splits,
                                                   softcap=3.0)
    check_against_reference(q, k_cache, v_cache, lens, k_new, v_new, True, out, lse, softcap=3.0)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["none", "fully_masked_rows", "key_lengths", "sparse_tiles"])
def test_cuda_sinks_on_tile_masks(cuda_family, mask):
    """Longer rows than a tile, rows and whole tiles that see nothing."""
    from helpers.cuda import check_cuda, check_cuda_backward

    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=600, seqlen_k=900, head_dim=128, dtype=torch.bfloat16,
                mask=mask, is_causal=True, sinks=True)
    check_cuda(case)
    check_cuda_backward(case)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("splits,merge", [(1, None), (4, True), (8, True), (4, False), (8, False), (None, None)],
                         ids=["one-split", "4-cluster", "8-cluster", "4-global", "8-global", "auto"])
def test_cuda_decode_sinks(head_dim, splits, merge):
    """The sink joins once: in the decode kernel with one split, else in the
    merge (cluster and global); the plan says which path ran. The empty
    first cache gives out 0 and lse = the sink."""
    if merge and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("thread block clusters need sm_90")
    q, k_cache, v_cache, lens, _, _ = (t if t is None else t.cuda() for t in
                                       make_cache(B=3, Hq=8, Hkv=2, d=head_dim, max_len=2048, nq=2, n_new=0,
                                                  dtype=torch.float16, seed=head_dim))
    sinks = torch.linspace(-2.0, 6.0, 8, device="cuda")
    with fusedattn.backends.force(decode_merge_in_cluster=merge):
        plan = fusedattn.plan_kvcache(q, k_cache, v_cache, num_splits=splits, sinks=sinks)
        out, lse = torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, lens, None, None, True, None, splits,
                                                       merge, sinks=sinks)
    assert plan["family"] == "decode" and (splits is None or plan["num_splits"] == splits), plan
    if merge is not None and splits > 1:
        assert plan["merge_in_cluster"] == merge, plan
    check_against_reference(q, k_cache, v_cache, lens, None, None, True, out, lse, sinks=sinks)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(lse[0], sinks[:, None].expand(8, 2))


def test_supports_says_where_each_option_runs():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fusedattn.ops.supports(cpu, torch.bfloat16, 64, softcap=True, sinks=True)
    # The fused kernels soft-cap, forward and backward, where there are CUDA kernels at all.
    has_cuda_kernels = fusedattn.ops.has_kernel("forward", "cuda")
    assert fusedattn.ops.supports(cuda, torch.float16, 64, softcap=True, fused=True) == has_cuda_kernels
    assert fusedattn.ops.supports(cuda, torch.float16, 64, softcap=True) == has_cuda_kernels
    assert fusedattn.ops.supports(cuda, torch.float16, 64, softcap=True, backward=False) == \
        fusedattn.ops.supports(cuda, torch.float16, 64)
    assert fusedattn.ops.supports(cuda, torch.float16, 64, sinks=True) == fusedattn.ops.supports(cuda, torch.float16, 64)
