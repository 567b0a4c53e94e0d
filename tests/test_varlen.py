"""attention_varlen: packed sequences of different lengths, causal and sliding
windows per sequence, forward and backward, on every backend (the CPU kernel,
sm80, sm90: the `backend` fixture), against the float64 reference sequence by
sequence; each call's plan asserted (on CUDA: one work item per tile, longest
first)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fusedattn
from fusedattn.ops import cuda_head_dims
from helpers.backends import Backend
from helpers.cuda import poison_allocator, sm90_available
from helpers.varlen_cases import check_varlen, check_varlen_backward, packed, sequence, tiles

# Empty sequences on either side, one token, Nq != Nk both ways, several tiles, a long one (the
# CPU's shorter: its kernel has no tiles to cross, and the float64 reference is the cost).
LENGTHS_Q = [5, 0, 1, 200, 3, 130, 64, 700]
LENGTHS_K = [5, 9, 1, 140, 0, 260, 64, 700]
CPU_LENGTHS_Q = [5, 0, 1, 40, 3, 17]
CPU_LENGTHS_K = [5, 9, 1, 33, 0, 70]
# The mix the longest-first order is for: 96 short sequences and one of 2K.
SHORT_AND_LONG = [2048] + [17, 64, 100, 250] * 24
# Every form of window: left only, right only, both, 0 (each query its diagonal key), wider than
# every sequence, one side open.
WINDOWS = [(3, 0), (0, 2), (30, 0), (17, 40), (0, 0), (900, 900), (-1, 5), (5, -1)]


def planned(backend, lengths_q, lengths_k, backward=False, head_dim=64, d_v=None, **options):
    """The plan of the call on `backend`, asserted: its family, packed, and on CUDA one work item
    per query (backward: key) tile, longest first. None where a forced sm90 refuses the call
    (its forward's, or with `backward` its backward's, head dims or options), which it may only
    where the planner, left to itself, would not give the call to sm90; then the call itself
    must raise."""
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, d=head_dim, d_v=d_v, dtype=backend.primary_dtype,
                                 device=backend.device)
    for pass_backward in (False, True) if backward else (False,):  # a backward's call runs the forward first
        try:
            plan = fusedattn.plan_varlen(q, k, v, cu_q, cu_k, backward=pass_backward, **options)
        except RuntimeError as e:
            if backend.name != "sm90" or "was forced, but" not in str(e):
                raise
            with fusedattn.backends.force("auto"):
                unforced = fusedattn.plan_varlen(q, k, v, cu_q, cu_k, backward=pass_backward, **options)
            assert unforced["family"] != "sm90", f"a forced sm90 refused what the planner gives it: {e}; {unforced}"
            q.requires_grad_(backward)
            with pytest.raises(RuntimeError, match="was forced, but"):
                fusedattn.attention_varlen(q, k, v, cu_q, cu_k, **options).sum().backward()
            return None
    assert plan["family"] == backend.name and plan["varlen"], plan
    if backend.device == "cuda":
        tile, rows = (plan["block_n"], lengths_k) if backward else (plan["block_m"], lengths_q)
        assert plan["schedule"] == "longest-first" and plan["work_items"] == tiles(rows, tile), plan
    else:
        assert "work_items" not in plan and "schedule" not in plan, plan
    return plan


def lengths(backend):
    """The (query, key) lengths of the packed batch on this backend."""
    return (CPU_LENGTHS_Q, CPU_LENGTHS_K) if backend.device == "cpu" else (LENGTHS_Q, LENGTHS_K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [16, 40, 64, 128, 192, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_varlen_forward_matches_reference(backend, dtype, d, is_causal):
    backend.require_dtype(dtype)
    lengths_q, lengths_k = lengths(backend)
    if planned(backend, lengths_q, lengths_k, head_dim=d, is_causal=is_causal) is None:
        return
    if backend.device == "cuda":
        poison_allocator(((sum(lengths_q), 4, d), dtype), ((4, sum(lengths_q)), torch.float32))
    check_varlen(lengths_q, lengths_k, is_causal=is_causal, dtype=dtype, d=d, device=backend.device, seed=d)


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("window", [None] + WINDOWS, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
def test_varlen_forward_grouped_heads_and_windows(backend, heads, window, is_causal, d):
    """Each sequence's window aligned bottom-right on its own lengths, with and without
    is_causal; rows that see no key give 0 and lse -inf (float32 on the CPU, the tightest)."""
    lengths_q, lengths_k = lengths(backend)
    if planned(backend, lengths_q, lengths_k, head_dim=d, is_causal=is_causal, window=window) is None:
        return
    dtype = torch.float32 if backend.device == "cpu" else torch.bfloat16
    check_varlen(lengths_q, lengths_k, is_causal=is_causal, window=window, dtype=dtype, hq=heads[0],
                 hkv=heads[1], d=d, scale=0.2, device=backend.device, seed=1)


@pytest.mark.parametrize("d,d_v", [(64, 32), (128, 96)], ids=str)
@pytest.mark.parametrize("softcap", [None, 2.5], ids=["sinks", "softcap-sinks"])
def test_varlen_forward_softcap_sinks_and_value_head_dim(backend, softcap, d, d_v):
    """Sinks and soft-capping where the backend takes them (sm90 soft-caps at its capped head
    dims only: a forced sm90 refuses the others)."""
    lengths_q, lengths_k = lengths(backend)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=backend.device)
    if planned(backend, lengths_q, lengths_k, head_dim=d, d_v=d_v, is_causal=True, softcap=softcap,
               sinks=sinks) is None:
        return
    check_varlen(lengths_q, lengths_k, is_causal=True, softcap=softcap, sinks=sinks, dtype=torch.float16, d=d,
                 d_v=d_v, device=backend.device, seed=2)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
def test_varlen_forward_many_short_sequences_and_one_long(cuda_family, d):
    """The longest-first work list of the CUDA kernels (sm90 at d=128: persistent blocks taking
    items from it)."""
    backend = Backend(cuda_family)
    if planned(backend, SHORT_AND_LONG, SHORT_AND_LONG, head_dim=d, is_causal=True) is None:
        return
    check_varlen(SHORT_AND_LONG, SHORT_AND_LONG, is_causal=True, dtype=torch.bfloat16, hq=2, hkv=1, d=d,
                 device=backend.device, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("is_causal,window,softcap,sinks,d_v", [
    (False, None, None, False, 24), (True, None, None, True, 24), (True, (40, -1), 5.0, False, 10),
    (False, (3, 300), None, True, 10)], ids=["full", "causal-sinks", "window-capped-dv", "window-sinks-dv"])
def test_cpu_packed_call_is_each_sequences_dense_call(dtype, is_causal, window, softcap, sinks, d_v):
    """The CPU's one pass over a packed batch (tasks narrowed to their sequence) gives each
    sequence's dense call bit for bit, out, lse and gradients: sequences of one row, none, past a
    tile (forward 256 rows, backward 64 and 128), fewer keys than queries, GQA; the gradient rows of
    a sequence without queries or keys are zeros (the kernels write every row of uninitialised memory)."""
    lengths_q, lengths_k = [1, 0, 300, 57, 130, 9], [5, 12, 300, 20, 0, 9]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, hq=4, hkv=2, d=24, d_v=d_v, dtype=dtype, seed=11,
                                 requires_grad=True)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(13)) if sinks else None
    args = (is_causal, None, None, window, softcap, sinks)
    out, lse = torch.ops.fusedattn.forward_varlen(q, k, v, cu_q, cu_k, 300, 300, *args)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(12)).to(dtype)
    options = dict(is_causal=is_causal, window=window, softcap=softcap, sinks=sinks)
    grads = torch.autograd.grad(fusedattn.attention_varlen(q, k, v, cu_q, cu_k, 300, 300, **options), (q, k, v),
                                grad_out)
    for b in range(len(lengths_q)):
        mine = [sequence(g, cu, b) for g, cu in zip(grads, (cu_q, cu_k, cu_k))]
        if lengths_q[b] == 0 or lengths_k[b] == 0:  # out is 0 (or nothing): no gradient
            assert all(not g.any() for g in mine), f"sequence {b}"
            continue
        qb, kb, vb = sequence(q, cu_q, b), sequence(k, cu_k, b), sequence(v, cu_k, b)
        out_b, lse_b = torch.ops.fusedattn.forward(qb, kb, vb, None, *args)
        assert torch.equal(sequence(out, cu_q, b), out_b) and torch.equal(lse[:, cu_q[b]:cu_q[b + 1]], lse_b[0])
        theirs = torch.autograd.grad(fusedattn.attention(qb, kb, vb, **options), (q, k, v), sequence(grad_out, cu_q, b))
        for name, a, t, cu in zip("qkv", mine, theirs, (cu_q, cu_k, cu_k)):
            assert torch.equal(a, sequence(t, cu, b)), f"d{name} of sequence {b}"


@pytest.mark.parametrize("layout", ["head-major", "expanded"])
@pytest.mark.parametrize("d", [16, 64], ids=lambda d: f"d{d}")
def test_packed_gradients_are_contiguous_whatever_the_operands_layouts(backend, d, layout):
    """Head-major q, and k, v head-major or expanded over their heads (stride 0): the gradients
    are packed and contiguous, as the fake function says (opcheck compares the two), and each
    sequence's are its dense call's (bit for bit on the CPU; on CUDA within the dtype's rounding).
    d=16 runs padded on CUDA. A forced sm90 refuses expanded heads (a tensor map's stride 0) and
    d=16's backward; then the planner, left to itself, gives the call to another family."""
    dtype, family = backend.primary_dtype, None if backend.name == "cpu" else backend.name
    cu = torch.tensor([0, 7, 7, 77], dtype=torch.int32, device=backend.device)  # lengths 7, 0 and 70
    g = torch.Generator().manual_seed(14)

    def head_major(heads):
        return torch.randn(heads, 77, d, generator=g).to(backend.device, dtype).transpose(0, 1).requires_grad_()

    q = head_major(4)
    if layout == "head-major":
        k, v = head_major(2), head_major(2)
    else:
        k, v = (torch.randn(77, 1, d, generator=g).to(backend.device, dtype).expand(77, 2, d).requires_grad_()
                for _ in range(2))
    try:
        plan = fusedattn.plan_varlen(q, k, v, cu, cu, 70, 70, is_causal=True, backward=True)
    except RuntimeError as e:
        assert backend.name == "sm90" and "was forced, but" in str(e), e
        assert layout == "expanded" or d == 16, e
        with fusedattn.backends.force("auto"):
            assert fusedattn.plan_varlen(q, k, v, cu, cu, 70, 70, is_causal=True, backward=True)["family"] != "sm90"
        return
    assert plan["family"] == backend.name and plan["varlen"], plan
    out, lse = torch.ops.fusedattn.forward_varlen(q, k, v, cu, cu, 70, 70, True, None, family)
    grad_out = torch.randn(out.shape, generator=g).to(backend.device, dtype)
    args = (grad_out, q.detach(), k.detach(), v.detach(), out, lse, cu, cu, 70, 70, True, None, family)
    torch.library.opcheck(torch.ops.fusedattn.backward_varlen.default, args)
    grads = torch.ops.fusedattn.backward_varlen(*args)[:3]
    assert all(gr.is_contiguous() and gr.shape == t.shape for gr, t in zip(grads, (q, k, v)))
    for b in (0, 2):  # sequence 1 is empty
        qb, kb, vb = (sequence(t.detach(), cu, b).requires_grad_() for t in (q, k, v))
        with fusedattn.backends.force("auto"):  # the dense call in whichever family takes these strides
            theirs = torch.autograd.grad(fusedattn.attention(qb, kb, vb, is_causal=True), (qb, kb, vb),
                                         sequence(grad_out, cu, b))
        for name, mine, their in zip("qkv", grads, theirs):
            if backend.device == "cpu":
                assert torch.equal(sequence(mine, cu, b), their), f"d{name} of sequence {b}"
            else:
                torch.testing.assert_close(sequence(mine, cu, b), their, rtol=2e-2, atol=2e-2,
                                           msg=lambda m, n=name, b=b: f"d{n} of sequence {b}: {m}")


@given(st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70)), min_size=1, max_size=6), st.booleans(),
       st.sampled_from([1, 8, 24, 64]))
def test_varlen_random_lengths_on_the_cpu(lengths, is_causal, d):
    check_varlen([n for n, _ in lengths], [n for _, n in lengths], is_causal=is_causal, d=d, seed=len(lengths))


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=5),
       st.tuples(st.integers(-1, 60), st.integers(-1, 60)), st.booleans())
def test_varlen_random_windows_on_the_cpu(lengths, window, is_causal):
    check_varlen([n for n, _ in lengths], [n for _, n in lengths], is_causal=is_causal, window=window, d=8,
                 seed=len(lengths))


@settings(max_examples=20)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=4),
       st.tuples(st.integers(-1, 30), st.integers(-1, 30)), st.booleans())
def test_varlen_random_gradients_on_the_cpu(lengths, window, is_causal):
    """dq, dk, dv over random length lists (empty sequences, Nq_b != Nk_b, windows) against autograd
    of the reference per sequence."""
    check_varlen_backward([n for n, _ in lengths], [n for _, n in lengths], is_causal=is_causal, window=window,
                          dtype=torch.float32, d=8, seed=len(lengths))


@pytest.mark.parametrize("d", [64, 128, 96], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("is_causal,window", [(False, None), (True, None), (False, (40, 3)), (True, (7, -1))],
                         ids=["full", "causal", "window", "causal-window"])
def test_varlen_backward_matches_reference(backend, d, is_causal, window):
    lengths_q, lengths_k = lengths(backend)
    if planned(backend, lengths_q, lengths_k, backward=True, head_dim=d, is_causal=is_causal,
               window=window) is None:
        return
    check_varlen_backward(lengths_q, lengths_k, is_causal=is_causal, window=window, dtype=backend.primary_dtype,
                          d=d, hq=4, hkv=2, device=backend.device, seed=d)


@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("softcap", [None, 2.5], ids=["sinks", "softcap-sinks"])
def test_varlen_backward_sinks_softcap_and_mqa(backend, d, softcap):
    lengths_q, lengths_k = lengths(backend)
    sinks = torch.tensor([0.3, -0.7, 1.1, 0.0, 2.0, -2.0])
    if planned(backend, lengths_q, lengths_k, backward=True, head_dim=d, is_causal=True, softcap=softcap) is None:
        return
    check_varlen_backward(lengths_q, lengths_k, is_causal=True, sinks=sinks, softcap=softcap,
                          dtype=torch.bfloat16, d=d, hq=6, hkv=1, device=backend.device, seed=4)


@pytest.mark.gpu
def test_varlen_backward_many_short_sequences_and_one_long(cuda_family):
    backend = Backend(cuda_family)
    if planned(backend, SHORT_AND_LONG, SHORT_AND_LONG, backward=True, head_dim=128, is_causal=True) is None:
        return
    check_varlen_backward(SHORT_AND_LONG, SHORT_AND_LONG, is_causal=True, dtype=torch.bfloat16, hq=2, hkv=1,
                          d=128, device=backend.device, seed=6)


@pytest.mark.gpu
def test_varlen_backward_deterministic_is_bitwise_repeatable():
    """torch.use_deterministic_algorithms on CUDA: grad_q summed in a fixed order (sm90: at turns,
    each sequence's key tiles from its last; sm80: the dQ pass's own work list), the same bits
    twice."""
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, d=64, dtype=torch.float16, device="cuda", requires_grad=True)
    torch.use_deterministic_algorithms(True)
    try:
        plan = fusedattn.plan_varlen(q, k, v, cu_q, cu_k, is_causal=True, backward=True)
        assert plan["deterministic"] and plan["family"] == ("sm90" if sm90_available() else "sm80"), plan
        runs = []
        for _ in range(2):
            out = fusedattn.attention_varlen(q, k, v, cu_q, cu_k, is_causal=True)
            runs.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
        for a, b in zip(*runs):
            assert torch.equal(a, b)
        check_varlen_backward(LENGTHS_Q, LENGTHS_K, is_causal=True, dtype=torch.float16, d=64, device="cuda", seed=5)
    finally:
        torch.use_deterministic_algorithms(False)


# The calls the planner, unforced, gives to sm90 where the GPU has it and it serves the (padded)
# head dim and the options, else to sm80: (d, backward, options).
UNFORCED = [(d, False, {"is_causal": True}) for d in (40, 64, 128, 192, 256)]
UNFORCED += [(d, False, {"window": (17, 40)}) for d in (64, 128)]
UNFORCED += [(d, False, {"is_causal": True, "softcap": 2.5, "sinks": "sinks"}) for d in (64, 128)]
UNFORCED += [(d, True, {"is_causal": True}) for d in (40, 64, 96, 128)]
UNFORCED += [(d, True, {"window": (40, 3)}) for d in (64, 128)]
UNFORCED += [(d, True, {"is_causal": True, "softcap": 2.5}) for d in (64, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("d,backward,options", UNFORCED, ids=[f"d{d}-{'backward' if b else 'forward'}-{'-'.join(o)}"
                                                               for d, b, o in UNFORCED])
def test_varlen_unforced_takes_sm90_where_it_serves_else_sm80(d, backward, options):
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, d=d, dtype=torch.float16, device="cuda")
    if options.get("sinks"):
        options = {**options, "sinks": torch.tensor([0.5, -1.0, 2.0, 0.0], device="cuda")}
    plan = fusedattn.plan_varlen(q, k, v, cu_q, cu_k, backward=backward, **options)
    # d=40 runs padded to the kernels' next head dim (plan["head_dim"]); soft-capping at the capped ones.
    dims = cuda_head_dims("sm90_backward" if backward else "sm90_forward")
    capped = cuda_head_dims("sm90_backward" if backward else "sm90_forward_capped")
    sm90 = sm90_available() and plan["head_dim"] in dims and (options.get("softcap") is None or
                                                              plan["head_dim"] in capped)
    assert plan["family"] == ("sm90" if sm90 else "sm80") and plan["varlen"], plan


def test_varlen_computes_max_seqlens_and_agrees_with_the_dense_call(backend):
    """One sequence is the dense call; max_seqlen_* default from cu_seqlens."""
    q, k, v, cu_q, cu_k = packed([37], [50], d=64, dtype=backend.primary_dtype, device=backend.device, seed=5)
    if planned(backend, [37], [50], is_causal=True) is None:
        return
    dense = fusedattn.attention(sequence(q, cu_q, 0), sequence(k, cu_k, 0), sequence(v, cu_k, 0), is_causal=True)
    torch.testing.assert_close(fusedattn.attention_varlen(q, k, v, cu_q, cu_k, is_causal=True),
                               dense[0].transpose(0, 1), atol=0, rtol=0)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_plan_varlen_on_the_cpu(backward):
    """The CPU kernel's plan says varlen and takes the options; a bad offset is refused by the plan too."""
    q, k, v, cu_q, cu_k = packed([7, 0, 20], [7, 3, 25], seed=2)
    plan = fusedattn.plan_varlen(q, k, v, cu_q, cu_k, is_causal=True, backward=backward, window=(4, 0))
    assert (plan["family"], plan["varlen"], "deterministic" in plan) == ("cpu", True, backward), plan
    with pytest.raises(RuntimeError, match="cu_seqlens_q must end at the 27 rows of q, got 7"):
        fusedattn.plan_varlen(q, k, v, cu_q[:-1], cu_k)


@pytest.mark.parametrize("device,d,dtype", [("cpu", 16, torch.float32),
                                            pytest.param("cuda", 64, torch.bfloat16, marks=pytest.mark.gpu)],
                         ids=["cpu", "cuda"])
@pytest.mark.parametrize("window", [None, [3, 1]], ids=["no-window", "window"])
def test_varlen_opcheck_and_compile(device, d, dtype, window):
    q, k, v, cu_q, cu_k = packed([40, 0, 90], [60, 30, 90], d=d, dtype=dtype, device=device, requires_grad=True,
                                 seed=6)
    torch.library.opcheck(torch.ops.fusedattn.forward_varlen.default,
                          (q, k, v, cu_q, cu_k, 90, 90, True, None, None, window))
    q0, k0, v0 = (t.detach() for t in (q, k, v))
    out, lse = torch.ops.fusedattn.forward_varlen(q0, k0, v0, cu_q, cu_k, 90, 90, True, None, None, window)
    torch.library.opcheck(torch.ops.fusedattn.backward_varlen.default,
                          (torch.randn_like(out), q0, k0, v0, out, lse, cu_q, cu_k, 90, 90, True, None, None, window))
    torch._dynamo.reset()
    compiled = torch.compile(fusedattn.attention_varlen, fullgraph=True)
    window = None if window is None else tuple(window)
    out = compiled(q, k, v, cu_q, cu_k, 90, 90, True, window=window)
    torch.testing.assert_close(out, fusedattn.attention_varlen(q, k, v, cu_q, cu_k, 90, 90, True, window=window),
                               atol=0, rtol=0)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_max_seqlen_is_needed_under_compile_and_cu_seqlens_must_be_one_dimensional():
    q, k, v, cu_q, cu_k = packed([4, 6], [5, 7], seed=3)
    with pytest.raises(RuntimeError, match=r"fusedattn.attention_varlen: cu_seqlens_q must be int32 \[B \+ 1\], "
                                           r"got shape \[1, 3\]"):
        fusedattn.attention_varlen(q, k, v, cu_q[None], cu_k)
    with pytest.raises(RuntimeError, match=r"fusedattn.plan_varlen: cu_seqlens_k must be int32 \[B \+ 1\]"):
        fusedattn.plan_varlen(q, k, v, cu_q, cu_k[None])
    torch._dynamo.reset()
    compiled = torch.compile(fusedattn.attention_varlen, fullgraph=True)
    with pytest.raises(Exception, match=r"under torch.compile pass max_seqlen_q as a Python int"):
        compiled(q, k, v, cu_q, cu_k)
    out = compiled(q, k, v, cu_q, cu_k, 6, 7)  # with the lengths given it compiles
    torch.testing.assert_close(out, fusedattn.attention_varlen(q, k, v, cu_q, cu_k), atol=0, rtol=0)


BAD = {
    "int64 offsets": (lambda q, k, v, cq, ck: (q, k, v, cq.long(), ck), "cu_seqlens_q must be int32 \\[B \\+ 1\\]"),
    "not from 0": (lambda q, k, v, cq, ck: (q, k, v, cq + 1, ck), "cu_seqlens_q must start at 0, got 1"),
    "decreasing": (lambda q, k, v, cq, ck: (q, k, v, torch.tensor([0, 5, 3, 9], dtype=torch.int32), ck),
                   "cu_seqlens_q must not decrease, got 5 then 3 at sequence 1"),
    "short of the total": (lambda q, k, v, cq, ck: (q[:-1], k, v, cq, ck), "must end at the 8 rows of q, got 9"),
    "other batch": (lambda q, k, v, cq, ck: (q, k[:-1], v[:-1], cq, ck[:-1]),
                    "must describe the same number of sequences, got 3 and 2"),
    "4-D q": (lambda q, k, v, cq, ck: (q.unsqueeze(0), k, v, cq, ck), "q must be \\[total_q, Hq, d\\]"),
    "heads": (lambda q, k, v, cq, ck: (q[:, :3], k, v, cq, ck), "Hq a multiple of Hkv"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_varlen_bad_input_says_what_was_expected(case):
    q, k, v, cu_q, cu_k = packed([3, 2, 4], [4, 4, 1])
    change, message = BAD[case]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fusedattn.forward_varlen(*change(q, k, v, cu_q, cu_k), 9, 9)


@pytest.mark.parametrize("window", [[1, 2, 3], [-2, 0], [4]], ids=str)
def test_varlen_bad_window_says_what_was_expected(window):
    q, k, v, cu_q, cu_k = packed([3, 2, 4], [4, 4, 1])
    with pytest.raises(RuntimeError, match=r"forward_varlen: window must be two ints \[left, right\], each >= -1"):
        torch.ops.fusedattn.forward_varlen(q, k, v, cu_q, cu_k, 4, 4, window=window)
    out, lse = torch.ops.fusedattn.forward_varlen(q, k, v, cu_q, cu_k, 4, 4)
    with pytest.raises(RuntimeError, match=r"backward_varlen: window must be two ints"):
        torch.ops.fusedattn.backward_varlen(out, q, k, v, out, lse, cu_q, cu_k, 4, 4, window=window)


def test_varlen_max_seqlen_below_a_length_is_an_error():
    q, k, v, cu_q, cu_k = packed([3, 6], [4, 4])
    with pytest.raises(RuntimeError, match="sequence 1 has 6 rows, more than max_seqlen_q = 5"):
        fusedattn.attention_varlen(q, k, v, cu_q, cu_k, 5, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not sm90_available(), reason="needs the sm90 family (Hopper)")
def test_varlen_forced_sm90_says_why_not():
    q, k, v, cu_q, cu_k = packed([10, 20], [10, 20], d=32, dtype=torch.float16, device="cuda")
    with fusedattn.backends.force("sm90"), pytest.raises(RuntimeError, match="the sm90 forward has head dims"):
        fusedattn.attention_varlen(q, k, v, cu_q, cu_k)


@pytest.mark.gpu
def test_varlen_cuda_refusals_name_the_limit():
    q, k, v, cu_q, cu_k = packed([10, 20], [10, 20], d=64, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be on q's device"):
        fusedattn.attention_varlen(q, k, v, cu_q.cpu(), cu_k)
    with pytest.raises(RuntimeError, match="cu_seqlens_k must not decrease"):
        fusedattn.attention_varlen(q, k, v, cu_q, torch.tensor([0, 25, 20], dtype=torch.int32, device="cuda"))
    # Past the kernels' head dims: the gemm family (tests/test_gemm_family.py); soft-capped calls stay on the kernels.
    big = max(cuda_head_dims("sm80_forward")) + 8
    q, k, v, cu_q, cu_k = packed([10], [10], d=big, dtype=torch.float16, device="cuda")
    assert fusedattn.plan_varlen(q, k, v, cu_q, cu_k)["family"] == "gemm"
    q, k, v, cu_q, cu_k = packed([10], [10], d=64, dtype=torch.float16, device="cuda")
    assert fusedattn.plan_varlen(q, k, v, cu_q, cu_k, softcap=3.0)["family"] in ("sm80", "sm90")
    assert fusedattn.plan_varlen(q, k, v, cu_q, cu_k, softcap=3.0, backward=True)["family"] in ("sm80", "sm90")
