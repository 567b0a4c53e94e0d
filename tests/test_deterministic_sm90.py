"""The sm90 backward's deterministic mode (torch.use_deterministic_algorithms(True)):
the key blocks add their dQ shares into each query tile at turns, in a fixed
order (cpp/cuda/common/key_block_scheduler.cuh), so ten runs give the same
bits; the gradients against autograd of the float64 reference (checked outside
deterministic mode, whose cuBLAS calls in the reference would need
CUBLAS_WORKSPACE_CONFIG), the plan asserted. Marker `gpu`; skipped where the
build or GPU lacks the sm90 kernels."""

import pytest
import torch

import fusedattn
from fusedattn.bench import _deterministic_algorithms as deterministic
from helpers.attention_cases import Case, check_backward, make_inputs
from helpers.cuda import poison_allocator
from helpers.varlen_cases import check_varlen_backward, packed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("sm90")]
# The mode's kernels: up to d=192 (d=192: the wide kernel's), without attn_mask (those calls: sm80's
# pass); soft-capped at the capped kernels' head dims.
SM90_HEAD_DIMS = [d for d in fusedattn.ops.cuda_head_dims("sm90_backward") if d <= 192]
CAPPED_HEAD_DIMS = [d for d in SM90_HEAD_DIMS if d in fusedattn.ops.cuda_head_dims("sm90_backward_capped")]
RUNS = 10
BANDS = [(False, None), (True, None), (False, (200, 30)), (True, (300, 0))]
BAND_IDS = ["full", "causal", "window", "causal-window"]


def assert_same_bits(runs):
    """Every run's gradients bit for bit the first's (signed zeros and NaNs included)."""
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("seqlens", [(113, 97), (1025, 1025), (700, 1300), (1300, 200), (64, 1300), (2100, 4300)],
                         ids=["113x97", "1025", "700x1300", "1300x200", "64x1300", "2100x4300"])
@pytest.mark.parametrize("is_causal,window", BANDS, ids=BAND_IDS)
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
def test_deterministic_backward_gives_the_same_bits_and_the_reference(head_dim, is_causal, window, seqlens):
    """Query tiles that many key blocks visit (1025 and more keys: 9 and more of 128), GQA
    (dK and dV summed over two query heads), awkward lengths and queries that see no key
    (causal with Nq > Nk: zero gradients), over NaN-filled freed blocks of the outputs' and
    workspaces' sizes. Without a band, the key blocks' walks are rotated except where
    fewer steps than key blocks (64x1300) or more key blocks than the GPU holds at once
    for the rotation (4300 keys: 34) start them together (DqRotation)."""
    dtype = torch.bfloat16 if head_dim in (128, 192) else torch.float16
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=seqlens[0], seqlen_k=seqlens[1], head_dim=head_dim,
                dtype=dtype, is_causal=is_causal, window=window)
    q, k, v, _ = make_inputs(case, "cuda", requires_grad=True)
    grad_out = torch.randn_like(q)
    with deterministic():
        plan = fusedattn.plan(q, k, v, None, is_causal, backward=True, window=window)
        assert (plan["family"], plan["deterministic"], plan["head_splits"]) == ("sm90", True, 1), plan
        runs = []
        for _ in range(RUNS):
            poison_allocator(*[(q.shape, dtype)] * 3, (q.shape, torch.float32), (q.shape[:3], torch.float32))
            runs.append(torch.autograd.grad(fusedattn.attention(q, k, v, None, is_causal, window=window),
                                            (q, k, v), grad_out))
    assert_same_bits(runs)
    check_backward(case, device="cuda", grads=runs[0], grad_out=grad_out)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
def test_deterministic_backward_over_many_waves_agrees_with_the_default(head_dim, is_causal):
    """More key blocks than the SMs hold (B=4 x 8 KV heads x 32 key blocks): blocks wait on
    turns of blocks long finished and on chains longer than a wave; every run the same bits,
    and the default mode's gradients (float32 sums in another order) to a bf16 rounding."""
    case = Case(batch=4, heads_q=16, heads_kv=8, seqlen_q=4096, seqlen_k=4096, head_dim=head_dim,
                dtype=torch.bfloat16, is_causal=is_causal)
    q, k, v, _ = make_inputs(case, "cuda", requires_grad=True)
    grad_out = torch.randn_like(q)
    call = lambda: torch.autograd.grad(fusedattn.attention(q, k, v, None, is_causal), (q, k, v), grad_out)  # noqa: E731
    with deterministic():
        assert fusedattn.plan(q, k, v, None, is_causal, backward=True)["deterministic"]
        runs = [call() for _ in range(RUNS)]
    assert_same_bits(runs)
    for a, b in zip(runs[0], call()):
        torch.testing.assert_close(a, b, atol=2e-2 * b.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("is_causal,window", BANDS, ids=BAND_IDS)
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
def test_deterministic_varlen_backward_takes_each_sequence_from_its_last_key_tile(head_dim, is_causal, window):
    """Packed sequences, among them an empty one and one shorter than a tile: the work list
    holds each sequence's key tiles from its last (a block waits only on blocks launched
    before it) and every run gives the same bits; then check_varlen_backward's own call in
    deterministic mode against the reference, sequence by sequence (computed on the CPU)."""
    lengths_q, lengths_k = [300, 5, 1000, 0, 129, 640], [260, 5, 1100, 3, 129, 640]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, d=head_dim, dtype=torch.float16, device="cuda",
                                 requires_grad=True)
    grad_out = torch.randn_like(q)
    with deterministic():
        plan = fusedattn.plan_varlen(q, k, v, cu_q, cu_k, is_causal=is_causal, window=window, backward=True)
        assert (plan["family"], plan["deterministic"], plan["schedule"]) == ("sm90", True, "last-first"), plan
        runs = [torch.autograd.grad(fusedattn.attention_varlen(q, k, v, cu_q, cu_k, is_causal=is_causal,
                                                               window=window), (q, k, v), grad_out)
                for _ in range(RUNS)]
        assert_same_bits(runs)
        check_varlen_backward(lengths_q, lengths_k, is_causal=is_causal, window=window, dtype=torch.float16,
                              d=head_dim, device="cuda")


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_deterministic_varlen_backward_with_many_kv_heads_ends(is_causal):
    """A packed call lists a sequence's key tiles of every kv head side by side: 16 kv heads
    of 16 key tiles are more blocks than the GPU holds at once, so its key blocks must wait
    only on blocks launched before them (a wait on a later one hangs, then traps)."""
    q, k, v, cu_q, cu_k = packed([2048], [2048], hq=16, hkv=16, d=128, dtype=torch.bfloat16, device="cuda",
                                 requires_grad=True)
    grad_out = torch.randn_like(q)
    call = lambda: torch.autograd.grad(fusedattn.attention_varlen(q, k, v, cu_q, cu_k, is_causal=is_causal),  # noqa: E731
                                       (q, k, v), grad_out)
    with deterministic():
        plan = fusedattn.plan_varlen(q, k, v, cu_q, cu_k, is_causal=is_causal, backward=True)
        assert (plan["family"], plan["deterministic"], plan["schedule"]) == ("sm90", True, "last-first"), plan
        runs = [call() for _ in range(2)]
    assert_same_bits(runs)
    for a, b in zip(runs[0], call()):
        torch.testing.assert_close(a, b, atol=2e-2 * b.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("is_causal,window", BANDS, ids=BAND_IDS)
@pytest.mark.parametrize("head_dim", CAPPED_HEAD_DIMS)
def test_deterministic_soft_capped_backward_gives_the_same_bits_and_the_reference(head_dim, is_causal, window):
    """Soft-capped calls have ordered kernels of their own (tanh's derivative in dS^T): the same
    bits over ten runs, the reference's gradients, at a length of 9 key blocks per query tile. The
    planner picks every family (the sm90 forward soft-caps at fewer head dims than its backward)."""
    dtype = torch.bfloat16 if head_dim == 128 else torch.float16
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=700, seqlen_k=1100, head_dim=head_dim, dtype=dtype,
                is_causal=is_causal, window=window, softcap=7.5)
    q, k, v, _ = make_inputs(case, "cuda", requires_grad=True)
    grad_out = torch.randn_like(q)
    with deterministic(), fusedattn.backends.force("auto"):
        plan = fusedattn.plan(q, k, v, None, is_causal, backward=True, window=window, softcap=case.softcap)
        assert (plan["family"], plan["deterministic"], plan["head_splits"]) == ("sm90", True, 1), plan
        runs = [torch.autograd.grad(fusedattn.attention(q, k, v, None, is_causal, window=window,
                                                        softcap=case.softcap), (q, k, v), grad_out)
                for _ in range(RUNS)]
    assert_same_bits(runs)
    check_backward(case, device="cuda", grads=runs[0], grad_out=grad_out)


def test_deterministic_mode_takes_attn_mask_to_sm80():
    """attn_mask (its key blocks' visits come from the mask's lists, which have no rank) has no
    deterministic sm90 kernel: forced there it is an error that says so, and the planner's own
    choice is sm80's deterministic pass."""
    case = Case(seqlen_q=200, seqlen_k=300, head_dim=64, dtype=torch.float16, mask="key_padding")
    q, k, v, mask = make_inputs(case, "cuda", requires_grad=True)
    with deterministic():
        with pytest.raises(RuntimeError, match="deterministic mode .*without attn_mask"):
            fusedattn.plan(q, k, v, mask, backward=True)
        with fusedattn.backends.force("auto"):
            plan = fusedattn.plan(q, k, v, mask, backward=True)
    assert (plan["family"], plan["deterministic"]) == ("sm80", True), plan
