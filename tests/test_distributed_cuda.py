"""Ring attention on NCCL, one GPU per rank (needs two GPUs: NCCL refuses two
ranks on one device), in the CUDA kernels' dtypes, against the float64 reference."""

import pytest
import torch

from fusedattn import distributed as fd
from helpers.attention_cases import Case, check_backward, check_forward
from helpers.ring_workers import RingCase, grad_out_of, spawn_ring

pytestmark = pytest.mark.gpu

CASES = [RingCase(Case(2, 8, 2, 2 * 2 * 300, 2 * 2 * 300, d, dtype=dtype, is_causal=causal, seed=d), layout)
         for d in (64, 128) for dtype in (torch.bfloat16, torch.float16) for causal in (False, True)
         for layout in fd.LAYOUTS]


@pytest.fixture(scope="module")
def nccl_results(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (one NCCL rank each), this machine has {torch.cuda.device_count()}")
    got = spawn_ring(2, tmp_path_factory.mktemp("nccl"), CASES, [], device_type="cuda")
    if isinstance(got, str):
        pytest.fail(got)
    return got


@pytest.mark.parametrize("ring_case", CASES, ids=str)
def test_nccl_ring_matches_whole_sequence_attention(nccl_results, ring_case):
    got = nccl_results[str(ring_case)]
    c = ring_case.case
    check_forward(c, out=got["out"])
    check_backward(c, grads=(got["dq"], got["dk"], got["dv"]), grad_out=grad_out_of(c))
