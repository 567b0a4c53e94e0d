"""fusedattn.plan / plan_kvcache (the planner's answer, without running the
call) and fusedattn.backends.force (what tests and benchmarks may fix)."""

import re
import threading
from pathlib import Path

import pytest
import torch

import fusedattn
from fusedattn.ops import cuda_head_dims

from helpers.cuda import served_head_dims, sm90_available
from helpers.kernel_table import generated_table


def qkv(d=16, dtype=torch.float32, device="cpu", nq=5, nk=7):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, nq, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(2, 2, nk, d, generator=g).to(device=device, dtype=dtype)
    return q, k, torch.randn_like(k)


def test_cpu_plan_forward_and_backward():
    q, k, v = qkv()
    assert fusedattn.plan(q, k, v) == {"family": "cpu", "block_m": 256, "block_n": 256, "warps": 0}
    backward = fusedattn.plan(q, k, v, is_causal=True, backward=True)
    assert backward["family"] == "cpu" and backward["head_splits"] == 1 and backward["deterministic"] is False
    assert (backward["block_m"], backward["block_n"]) == (64, 128)
    assert fusedattn.plan_kvcache(q, k, v)["family"] == "cpu"


def test_plan_checks_arguments_as_the_call_does():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="fusedattn.plan: "):
        fusedattn.plan(q, k[:, :1].expand(2, 3, 7, 16), v)


def test_cpu_refuses_a_cuda_family():
    q, k, v = qkv()
    with fusedattn.backends.force("sm80"):
        with pytest.raises(RuntimeError, match="family must be None, 'auto', 'cpu' or 'gemm' for cpu tensors, got 'sm80'"):
            fusedattn.attention(q, k, v)
        with pytest.raises(RuntimeError, match="got 'sm80'"):
            fusedattn.plan(q, k, v)
    with pytest.raises(RuntimeError, match="got 'tpu'"):
        torch.ops.fusedattn.forward(q, k, v, None, False, None, "tpu")
    with fusedattn.backends.force("cpu"):
        torch.testing.assert_close(fusedattn.attention(q, k, v), fusedattn.reference.attention(q, k, v),
                                   atol=1e-5, rtol=1e-5)


def test_force_checks_its_arguments():
    with pytest.raises(ValueError, match="family must be one of"):
        with fusedattn.backends.force("sm70"):
            pass
    with pytest.raises(ValueError, match="decode_warps must be 4, 8 or None, got 6"):
        with fusedattn.backends.force(decode_warps=6):
            pass
    with pytest.raises(ValueError, match="decode_merge_in_cluster must be True, False or None"):
        with fusedattn.backends.force(decode_merge_in_cluster=1):
            pass


def test_force_nests_and_is_per_thread():
    seen = {}
    with fusedattn.backends.force("sm80", decode_warps=4):
        with fusedattn.backends.force(decode_merge_in_cluster=False):
            inner = fusedattn.backends.forced()
        with fusedattn.backends.force("auto"):
            auto = fusedattn.backends.forced()
        thread = threading.Thread(target=lambda: seen.setdefault("other", fusedattn.backends.forced()))
        thread.start()
        thread.join()
        assert fusedattn.backends.forced().family == "sm80"
    assert (inner.family, inner.decode_warps, inner.decode_merge_in_cluster) == ("sm80", 4, False)
    assert (auto.family, auto.decode_warps) == (None, 4)
    assert seen["other"] == fusedattn.backends.Forced()
    assert fusedattn.backends.forced() == fusedattn.backends.Forced()


def test_a_forced_choice_does_not_vanish_under_torch_compile():
    """Dynamo cannot read force()'s context variable: tracing inside force() raises
    instead of compiling the planner's choice in its place; outside it, nothing is forced."""
    q, k, v = qkv()
    torch._dynamo.reset()
    compiled = torch.compile(fusedattn.attention, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), fusedattn.attention(q, k, v))
    with fusedattn.backends.force("gemm"):  # traced again (the compiled graph guards on force()), and refused
        with pytest.raises(Exception, match="does not reach code that torch.compile traces"):
            compiled(q, k, v)
    torch.testing.assert_close(compiled(q, k, v), fusedattn.attention(q, k, v))


def test_cpu_decode_overrides_are_checked():
    q, k, v = qkv()
    lens = torch.tensor([3, 7], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"num_splits must be None or in \[1, 64\], got 0"):
        fusedattn.attention_with_kvcache(q, k, v, lens, num_splits=0)
    with pytest.raises(RuntimeError, match=r"got 65"):
        fusedattn.plan_kvcache(q, k, v, num_splits=65)
    with fusedattn.backends.force(decode_merge_in_cluster=True):
        with pytest.raises(RuntimeError, match="pass None for CPU tensors"):
            fusedattn.attention_with_kvcache(q, k, v, lens)
    out = fusedattn.attention_with_kvcache(q, k, v, lens, num_splits=4)  # accepted, ignored
    torch.testing.assert_close(out, fusedattn.attention_with_kvcache(q, k, v, lens))


def test_the_library_reads_no_environment_variable():
    """Choices are arguments (and fusedattn.backends.force), never the environment."""
    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"\benviron\b|getenv|get_env|check_env")
    found = [f"{path.relative_to(root)}:{n}" for folder in ("cpp", "python/fusedattn")
             for path in sorted((root / folder).rglob("*")) if path.suffix in (".py", ".h", ".cuh", ".cpp", ".cu")
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found


@pytest.mark.skipif(not fusedattn.ops.has_kernel("forward", "cuda"), reason="this build has no CUDA kernels")
def test_the_library_reports_the_generated_table():
    """supports() and the CLI read the head dims from the library, which has them from the table."""
    for kernel, dims in generated_table().items():
        assert cuda_head_dims(kernel) == dims, kernel
    top = min(served_head_dims()[-1], served_head_dims(backward=True)[-1])
    cuda = torch.device("cuda")
    for d in range(1, 300):  # below the largest served dim, the kernels run it padded; above, the gemm family
        assert fusedattn.ops.supports(cuda, torch.float16, d, fused=True) == (d <= top)
        assert fusedattn.ops.supports(cuda, torch.float16, d)
    assert fusedattn.ops.supports(cuda, torch.float16, 64, softcap=True, sinks=True, fused=True)
    assert not fusedattn.ops.supports(cuda, torch.float32, 64, fused=True)
    assert fusedattn.ops.supports(cuda, torch.float32, 64)
    with pytest.raises(RuntimeError, match="no kernel named 'sm70_forward'"):
        torch.ops.fusedattn.instantiated_head_dims("sm70_forward")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_plans(dtype):
    """The planner's rules as documented: sm90 on Hopper for head dims 64 and
    128 (attn_mask too), the forward at 192 and 256 (112- and 80-key tiles,
    no attn_mask), soft-capped at its capped head dims and the backward's
    (no attn_mask),
    176-key tiles at d=128 without a mask, sm80 elsewhere; the backward's
    deterministic mode on sm90 too, without attn_mask."""
    def plan(d, mask=False, causal=False, nk=700, backward=False, softcap=None):
        q, k, v = qkv(d, dtype, "cuda", nq=300, nk=nk)
        m = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device="cuda") if mask else None
        return fusedattn.plan(q, k, v, m, causal, backward=backward, softcap=softcap)

    hopper = sm90_available()
    for d in cuda_head_dims():
        takes = hopper and d in cuda_head_dims("sm90_forward")
        assert plan(d)["family"] == ("sm90" if takes else "sm80")
        masked = hopper and d in cuda_head_dims("sm90_forward_masked")
        assert plan(d, mask=True)["family"] == ("sm90" if masked else "sm80")
        backward_family = "sm90" if hopper and d in cuda_head_dims("sm90_backward") else "sm80"
        assert plan(d, mask=True, backward=True)["family"] == backward_family
        assert plan(d, backward=True)["family"] == backward_family
        assert plan(d)["head_dim"] == plan(d, backward=True)["head_dim"] == d
    # Between the served dims, the next one's families (d=48 pads to 64, d=20 to 32).
    for d in (20, 48, 100):
        served = min(x for x in cuda_head_dims() if x >= d)
        assert plan(d)["family"] == plan(served)["family"] and plan(d)["head_dim"] == served
        assert plan(d, backward=True)["family"] == plan(served, backward=True)["family"]
    if hopper:
        assert plan(128)["block_n"] == 176 and plan(128, mask=True)["block_n"] == 128
        assert plan(128, causal=True)["block_n"] == 128 and plan(128, causal=True, nk=16384)["block_n"] == 176
        assert plan(64)["persistent"] is False and plan(64, causal=True)["persistent"] is True
        # d=192 and 256: sm90's forward in 112- and 80-key tiles, persistent; attn_mask there on sm80.
        # The backward: sm90's wide kernel (64 x 64 tiles) without attn_mask or soft-capping, else
        # the gemm family.
        for d, keys in ((192, 112), (256, 80)):
            wide = plan(d)
            assert (wide["family"], wide["block_n"], wide["persistent"], wide["head_dim"]) == ("sm90", keys, True, d)
            assert plan(d, causal=True)["block_n"] == keys and plan(d, mask=True)["family"] == "sm80"
            backward = plan(d, backward=True)
            assert (backward["family"], backward["block_m"], backward["block_n"]) == ("sm90", 64, 64), backward
            assert plan(d, mask=True, backward=True)["family"] == plan(d, softcap=5.0, backward=True)["family"] == "gemm"
        # Soft-capped forwards: sm90 unmasked at its capped head dims, sm80 elsewhere.
        for d in cuda_head_dims():
            capped = d in cuda_head_dims("sm90_forward_capped")
            assert plan(d, softcap=5.0)["family"] == ("sm90" if capped else "sm80")
            assert plan(d, causal=True, softcap=5.0)["family"] == ("sm90" if capped else "sm80")
            assert plan(d, mask=True, softcap=5.0)["family"] == "sm80"
            # and backwards: sm90's unmasked at its backward's head dims, sm80 elsewhere.
            backward_family = "sm90" if d in cuda_head_dims("sm90_backward") else "sm80"
            assert plan(d, softcap=5.0, backward=True)["family"] == backward_family
            assert plan(d, mask=True, softcap=5.0, backward=True)["family"] == "sm80"
    with fusedattn.backends.force("sm80"):
        assert plan(128)["family"] == "sm80" and plan(128)["block_n"] == 64
    torch.use_deterministic_algorithms(True)
    try:
        deterministic = plan(64, backward=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert deterministic["family"] == ("sm90" if hopper else "sm80") and deterministic["deterministic"] is True
    assert deterministic["head_splits"] == 1


@pytest.mark.gpu
def test_cuda_decode_plans():
    q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(8, 8, 32768, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    auto = fusedattn.plan_kvcache(q, k, v)
    assert auto["family"] == "decode" and 1 <= auto["num_splits"] <= 64
    assert auto["block_n"] == 16 * auto["warps"]
    # The decode kernel's sm_90 code starts while the kernel before it ends; before Hopper there is none.
    if sm90_available():
        assert auto["dependent_launch"] is True, auto
    if torch.cuda.get_device_capability()[0] < 9:
        assert auto["dependent_launch"] is False, auto
    assert fusedattn.plan_kvcache(q, k, v, num_splits=3)["num_splits"] == 3
    assert fusedattn.plan_kvcache(q, k[:, :, :100], v[:, :, :100], num_splits=40)["num_splits"] == 2
    with fusedattn.backends.force(decode_warps=4):
        assert fusedattn.plan_kvcache(q, k, v)["warps"] == 4
    with fusedattn.backends.force(decode_merge_in_cluster=False):
        assert fusedattn.plan_kvcache(q, k, v, num_splits=4)["merge_in_cluster"] is False
    with pytest.raises(RuntimeError, match="decode blocks of 4 warps were forced"):
        with fusedattn.backends.force(decode_warps=4):
            small = q[..., :64].contiguous()
            fusedattn.plan_kvcache(small, k[..., :64].contiguous(), v[..., :64].contiguous())
