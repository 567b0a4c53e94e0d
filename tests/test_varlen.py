"""attention_varlen: packed sequences of different lengths, with causal and
sliding windows per sequence, against the float64 reference, sequence by
sequence (CPU; CUDA in test_varlen_cuda.py)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fusedattn
from fusedattn import reference
from helpers.attention_cases import assert_within_rule
from helpers.varlen_cases import check_varlen, packed, sequence


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_varlen_matches_reference(is_causal, dtype):
    """Empty sequences on either side, one token, Nq != Nk both ways, a long one."""
    check_varlen([5, 0, 1, 40, 3, 17], [5, 9, 1, 33, 0, 70], is_causal=is_causal, dtype=dtype)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_varlen_grouped_heads_and_scale(heads):
    check_varlen([7, 12], [9, 12], is_causal=True, hq=heads[0], hkv=heads[1], d=40, scale=0.3)


@given(st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70)), min_size=1, max_size=6), st.booleans(),
       st.sampled_from([1, 8, 24, 64]))
def test_varlen_random_lengths(lengths, is_causal, d):
    check_varlen([n for n, _ in lengths], [n for _, n in lengths], is_causal=is_causal, d=d, seed=len(lengths))


# Every form of window: left only, right only, both, 0 (each query its diagonal key), wider than
# every sequence, and one side open.
WINDOWS = [(3, 0), (0, 2), (4, 6), (0, 0), (500, 500), (-1, 3), (5, -1)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_varlen_windows(window, is_causal):
    """Each sequence's window aligned bottom-right on its own lengths (Nq_b != Nk_b both
    ways, empty and one-token sequences), with and without is_causal; rows that see no
    key give 0 and lse -inf."""
    check_varlen([5, 0, 1, 40, 3, 17], [5, 9, 1, 33, 0, 70], is_causal=is_causal, window=window)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=5),
       st.tuples(st.integers(-1, 60), st.integers(-1, 60)), st.booleans())
def test_varlen_random_windows(lengths, window, is_causal):
    check_varlen([n for n, _ in lengths], [n for _, n in lengths], is_causal=is_causal, window=window, d=8,
          seed=len(lengths))


@pytest.mark.parametrize("is_causal,window", [(False, None), (True, None), (False, (4, 2)), (True, (7, -1))],
                         ids=["full", "causal", "window", "causal-window"])
def test_varlen_gradients(is_causal, window):
    lengths_q, lengths_k = [6, 0, 19, 1, 4], [6, 5, 11, 0, 30]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, requires_grad=True, seed=3)
    out = fusedattn.attention_varlen(q, k, v, cu_q, cu_k, is_causal=is_causal, window=window)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs = [reference.attention(sequence(q64, cu_q, b), sequence(k64, cu_k, b), sequence(v64, cu_k, b),
                                is_causal=is_causal, window=window)[0].transpose(0, 1)
            for b in range(len(lengths_q))]
    oracle = torch.autograd.grad(torch.cat(outs), (q64, k64, v64), grad_out.double())
    for name, a, o in zip(("dq", "dk", "dv"), grads, oracle):
        torch.testing.assert_close(a.double(), o, atol=1e-4, rtol=1e-4, msg=name)


def test_varlen_computes_max_seqlens_and_agrees_with_the_dense_call():
    """One sequence is the dense call; max_seqlen_* default from cu_seqlens."""
    q, k, v, cu_q, cu_k = packed([37], [50], seed=5)
    dense = fusedattn.attention(sequence(q, cu_q, 0), sequence(k, cu_k, 0), sequence(v, cu_k, 0), is_causal=True)
    torch.testing.assert_close(fusedattn.attention_varlen(q, k, v, cu_q, cu_k, is_causal=True),
                               dense[0].transpose(0, 1), atol=0, rtol=0)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_plan_varlen_on_the_cpu(backward):
    """The CPU kernel serves packed calls; its plan says varlen and takes the options."""
    q, k, v, cu_q, cu_k = packed([7, 0, 20], [7, 3, 25], seed=2)
    plan = fusedattn.plan_varlen(q, k, v, cu_q, cu_k, is_causal=True, backward=backward, window=(4, 0))
    assert (plan["family"], plan["varlen"], "deterministic" in plan) == ("cpu", True, backward), plan
    assert "work_items" not in plan and "schedule" not in plan
    with pytest.raises(RuntimeError, match="cu_seqlens_q must end at the 27 rows of q, got 7"):
        fusedattn.plan_varlen(q, k, v, cu_q[:-1], cu_k)


@pytest.mark.parametrize("window", [None, [3, 1]], ids=["no-window", "window"])
def test_varlen_opcheck_and_compile(window):
    q, k, v, cu_q, cu_k = packed([4, 0, 9], [6, 3, 9], requires_grad=True, seed=6)
    torch.library.opcheck(torch.ops.fusedattn.forward_varlen.default,
                          (q, k, v, cu_q, cu_k, 9, 9, True, None, None, window))
    q0, k0, v0 = (t.detach() for t in (q, k, v))
    out, lse = torch.ops.fusedattn.forward_varlen(q0, k0, v0, cu_q, cu_k, 9, 9, True, None, None, window)
    torch.library.opcheck(torch.ops.fusedattn.backward_varlen.default,
                          (torch.randn_like(out), q0, k0, v0, out, lse, cu_q, cu_k, 9, 9, True, None, None, window))
    torch._dynamo.reset()
    compiled = torch.compile(fusedattn.attention_varlen, fullgraph=True)
    window = None if window is None else tuple(window)
    out = compiled(q, k, v, cu_q, cu_k, 9, 9, True, window=window)
    torch.testing.assert_close(out, fusedattn.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, True, window=window))
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


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
