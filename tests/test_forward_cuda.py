"""What only the CUDA forward has (marker `gpu`: skipped without a CUDA
device or without CUDA kernels in the build): long sequences, agreement with
the CPU, operands off 16 bytes, offsets past 2^31, streams, CUDA graphs,
torch.compile, opcheck, its refusals, the naive path. Features every backend
serves are in test_forward.py."""

import pytest
import torch

import fusedattn
from helpers.attention_cases import MASK_KINDS, Case, check_forward, make_inputs
from helpers.cuda import GPU_DTYPES, at_odd_offset, check_cuda, poison_allocator, sm90_available

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [4096, 8192])
@pytest.mark.parametrize("is_causal", [False, True])
def test_cuda_long_sequences(n, is_causal, cuda_family):
    check_cuda(Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=n, seqlen_k=n, head_dim=128,
                    dtype=torch.bfloat16, is_causal=is_causal))


def test_cuda_matches_cpu():
    case = Case(seqlen_q=200, seqlen_k=333, head_dim=64, dtype=torch.bfloat16, mask="additive",
                is_causal=True)
    q, k, v, mask = make_inputs(case, "cuda")
    out, lse = torch.ops.fusedattn.forward(q, k, v, mask, True, None)
    out_cpu, lse_cpu = torch.ops.fusedattn.forward(q.cpu(), k.cpu(), v.cpu(), mask.cpu(), True, None)
    torch.testing.assert_close(out.cpu(), out_cpu, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu(), lse_cpu, atol=1e-3, rtol=1e-3)


def test_cuda_contiguous_inputs_at_odd_offsets():
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=130, head_dim=128,
                dtype=torch.float16, is_causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    out, lse = torch.ops.fusedattn.forward(at_odd_offset(q), at_odd_offset(k), at_odd_offset(v), None, True, None)
    check_forward(case, device="cuda", out=out, lse=lse)


def test_cuda_offsets_beyond_int32():
    """B * H * N * d > 2^31 elements: the last head must be right."""
    B, H, N, d = 1, 520, 32768, 128  # 2.2e9 elements per tensor
    q = torch.randn(B, H, N, d, device="cuda", dtype=torch.float16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    out, _ = torch.ops.fusedattn.forward(q, k, v, None, True, None)
    last, _ = torch.ops.fusedattn.forward(q[:, -1:], k[:, -1:], v[:, -1:], None, True, None)
    torch.testing.assert_close(out[:, -1:], last, atol=0, rtol=0)
    tail = slice(N - 64, N)  # the reference on the last rows of the last head
    ref = fusedattn.reference.attention(q[:, -1:, tail].double(), k[:, -1:].double(),
                                        v[:, -1:].double(), is_causal=True)
    torch.testing.assert_close(out[:, -1:, tail].double(), ref, atol=2e-3, rtol=0)


def check_graph_replays(q, k, v, is_causal, replays):
    """The forward captured in a CUDA graph: each replay on fresh queries gives an eager call's
    bits, out and lse."""
    graph = torch.cuda.CUDAGraph()
    static_q = q.clone()
    with torch.cuda.graph(graph):
        graph_out, graph_lse = torch.ops.fusedattn.forward(static_q, k, v, None, is_causal, None)
    for _ in range(replays):
        static_q.copy_(torch.randn_like(q))
        graph.replay()
        fresh, fresh_lse = torch.ops.fusedattn.forward(static_q, k, v, None, is_causal, None)
        torch.testing.assert_close(graph_out, fresh, atol=0, rtol=0)
        torch.testing.assert_close(graph_lse, fresh_lse, atol=0, rtol=0)


def test_cuda_non_default_stream_and_graph():
    case = Case(seqlen_q=257, seqlen_k=300, head_dim=128, dtype=torch.float16, is_causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    expected, _ = torch.ops.fusedattn.forward(q, k, v, None, True, None)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out, _ = torch.ops.fusedattn.forward(q, k, v, None, True, None)
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)

    check_graph_replays(q, k, v, is_causal=True, replays=2)


@pytest.mark.parametrize("head_dim,is_causal", [(128, False), (64, True)])
def test_cuda_graph_replays_zero_the_work_counter(head_dim, is_causal):
    """288 query blocks: on a Hopper GPU the sm90 forward's persistent blocks (d=128, and d=64
    under causal) take them from a counter that each launch zeroes (a memset node in the
    graph), so every replay must give the eager call's bits; elsewhere this is one more graph
    test."""
    case = Case(batch=2, heads_q=72, heads_kv=24, seqlen_q=256, seqlen_k=300, head_dim=head_dim,
                dtype=torch.bfloat16, is_causal=is_causal)
    q, k, v, _ = make_inputs(case, "cuda")
    plan = fusedattn.plan(q, k, v, is_causal=is_causal)
    assert plan.get("persistent", False) == (sm90_available() and plan["family"] == "sm90"), plan
    if plan.get("persistent"):
        assert 288 > plan["resident_blocks"] > 0, plan  # more items than blocks: the counter deals the rest
    torch.ops.fusedattn.forward(q, k, v, None, is_causal, None)  # warm-up outside the capture
    check_graph_replays(q, k, v, is_causal=is_causal, replays=3)


def test_cuda_compile_fullgraph():
    torch._dynamo.reset()
    case = Case(seqlen_q=100, seqlen_k=100, head_dim=64, dtype=torch.bfloat16, mask="key_padding")
    q, k, v, mask = make_inputs(case, "cuda")
    f = torch.compile(lambda q, k, v, m: fusedattn.attention(q, k, v, m) * 2, fullgraph=True)
    torch.testing.assert_close(f(q, k, v, mask), fusedattn.attention(q, k, v, mask) * 2,
                               atol=0, rtol=0)


def test_cuda_opcheck():
    for case in [Case(dtype=torch.float16, head_dim=64, mask="bool", is_causal=True),
                 Case(dtype=torch.bfloat16, head_dim=32, mask="additive", seqlen_q=1)]:
        q, k, v, mask = make_inputs(case, "cuda")
        torch.library.opcheck(torch.ops.fusedattn.forward.default,
                              (q, k, v, mask, case.is_causal, case.scale))


@pytest.mark.parametrize("mask", MASK_KINDS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_cuda_naive_forward(mask, is_causal, dtype):
    """Seed 2's naive path (cuBLAS + fused row softmax) obeys the same contract."""
    case = Case(heads_q=4, heads_kv=2, seqlen_q=113, seqlen_k=800, head_dim=64, dtype=dtype,
                mask=mask, is_causal=is_causal)
    q, k, v, m = make_inputs(case, "cuda")
    poison_allocator((q.shape, q.dtype))
    out = torch.ops.fusedattn.naive_forward(q, k, v, m, is_causal, None)
    check_forward(case, device="cuda", out=out)


def test_cuda_naive_forward_opcheck():
    case = Case(dtype=torch.bfloat16, head_dim=32, mask="key_padding", is_causal=True)
    q, k, v, mask = make_inputs(case, "cuda")
    torch.library.opcheck(torch.ops.fusedattn.naive_forward.default, (q, k, v, mask, True, None))
