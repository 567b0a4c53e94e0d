"""Under torch.use_deterministic_algorithms, at::empty fills new memory with NaN
(torch.utils.deterministic.fill_uninitialized_memory), one more pass over every
byte. fusedattn's kernels write their outputs and workspaces in full before
anything reads them, so it allocates those without the fill
(cpp/ops/unfilled.h): a deterministic forward and backward runs no aten::fill_,
and its gradients stay within the rule of the float64 reference, over freed
blocks filled with NaN on CUDA (a region a kernel left unwritten would show).
On the CPU and on each CUDA family (the `backend` fixture, plans asserted), and
for a decoding step against a KV cache."""

import contextlib

import pytest
import torch
from torch.profiler import profile

import fusedattn
from fusedattn import reference
from fusedattn.bench import _deterministic_algorithms as deterministic
from helpers.attention_cases import Case, assert_within_rule, check_backward, make_inputs
from helpers.varlen_cases import check_varlen_backward, packed


def fills_in(call):
    """The shapes of the NaN fills (an aten::fill_ inside an empty tensor's allocation) that
    fusedattn's operators make during `call`."""
    def callers(event):
        while event.cpu_parent is not None:
            event = event.cpu_parent
            yield event.name

    with profile(record_shapes=True) as prof:
        call()
    return [e.input_shapes for e in prof.events() if e.name == "aten::fill_"
            and next(callers(e), "").startswith("aten::empty") and any(n.startswith("fusedattn::") for n in callers(e))]


def poison(device, *shapes):
    """On CUDA, freed blocks of these float32 shapes full of NaN, for the outputs to land in."""
    if device == "cuda":
        from helpers.cuda import poison_allocator

        poison_allocator(*[(s, torch.float32) for s in shapes])


@pytest.mark.parametrize("mask", ["none", "bool"])
def test_deterministic_backward_allocates_without_the_fill(backend, mask):
    """Dense calls, causal with GQA, and with an attn_mask (on CUDA the mode's other
    path, sm80's dQ pass)."""
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=200, seqlen_k=150, head_dim=64, dtype=backend.primary_dtype,
                mask=mask, is_causal=mask == "none")
    backend.require(case, backward=True)
    q, k, v, attn_mask = make_inputs(case, backend.device, requires_grad=True)
    grad_out = torch.randn_like(q)
    family, planner = backend.name, contextlib.nullcontext()
    if backend.name == "sm90" and mask != "none":  # no deterministic sm90 kernel takes attn_mask: sm80's pass
        family, planner = "sm80", fusedattn.backends.force("auto")
    with deterministic(), planner:
        plan = fusedattn.plan(q, k, v, attn_mask, case.is_causal, backward=True)
        assert (plan["family"], plan["deterministic"]) == (family, backend.device == "cuda"), plan

        def step():
            poison(backend.device, q.shape, q.shape[:3])
            grads.append(torch.autograd.grad(fusedattn.attention(q, k, v, attn_mask, case.is_causal), (q, k, v),
                                             grad_out))

        grads = []
        assert fills_in(step) == []
    check_backward(case, device=backend.device, grads=grads[0], grad_out=grad_out)


def test_deterministic_varlen_backward_allocates_without_the_fill(backend):
    """Packed sequences, an empty one among them (the packed gradients' own allocation)."""
    lengths = [70, 0, 130, 33]
    q, k, v, cu_q, cu_k = packed(lengths, lengths, d=64, dtype=backend.primary_dtype, requires_grad=True,
                                 device=backend.device)
    backend.require(Case(head_dim=64, dtype=backend.primary_dtype), backward=True)
    with deterministic():
        plan = fusedattn.plan_varlen(q, k, v, cu_q, cu_k, is_causal=True, backward=True)
        assert (plan["family"], plan["deterministic"]) == (backend.name, backend.device == "cuda"), plan
        out = fusedattn.attention_varlen(q, k, v, cu_q, cu_k, is_causal=True)
        grad_out = torch.ones_like(out)
        assert fills_in(lambda: torch.autograd.grad(out, (q, k, v), grad_out)) == []
        assert fills_in(lambda: fusedattn.attention_varlen(q, k, v, cu_q, cu_k, is_causal=True)) == []
        check_varlen_backward(lengths, lengths, is_causal=True, dtype=backend.primary_dtype, d=64,
                              device=backend.device)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_deterministic_decode_allocates_without_the_fill(device, num_splits):
    """A decoding step against a KV cache (on CUDA also split four ways, merged outside a
    cluster: the splits' partial outputs and arrival counters; the first sequence's 37 keys leave
    three splits empty), out and lse against the float64 reference over the cache's valid keys."""
    if device == "cuda" and not fusedattn.ops.has_kernel("forward_kvcache", "cuda"):
        pytest.skip("this build has no CUDA decode kernel")
    dtype = torch.float32 if device == "cpu" else torch.float16
    g = torch.Generator().manual_seed(0)
    q, k_cache, v_cache = (torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
                           for shape in ((2, 4, 1, 64), (2, 2, 1000, 64), (2, 2, 1000, 64)))
    lengths = torch.tensor([37, 1000], dtype=torch.int32, device=device)
    merge_in_cluster = False if device == "cuda" else None
    with deterministic(), fusedattn.backends.force(decode_merge_in_cluster=merge_in_cluster):
        plan = fusedattn.plan_kvcache(q, k_cache, v_cache, lengths, num_splits=num_splits)
        assert plan["family"] == ("cpu" if device == "cpu" else "decode"), plan
        if device == "cuda":
            assert (plan["num_splits"], plan["merge_in_cluster"]) == (num_splits, False), plan

        def step():
            poison(device, (num_splits, *q.shape), (num_splits, *q.shape[:3]), q.shape, q.shape[:3])
            outs.append(torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, lengths, None, None, True, None,
                                                            num_splits, merge_in_cluster, None))

        outs = []
        assert fills_in(step) == []
    out, lse = outs[0]
    for b, n in enumerate(lengths.tolist()):
        args = (q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n])
        oracle, oracle_lse = reference.attention_with_lse(*(t.double() for t in args))
        low, _ = reference.attention_with_lse(*args)
        assert_within_rule(f"out of sequence {b}", out[b:b + 1], oracle, low, dtype, factor=2)
        torch.testing.assert_close(lse[b:b + 1].double(), oracle_lse, atol=1e-4, rtol=1e-5)
