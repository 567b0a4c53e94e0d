"""The backends a feature test runs on: the CPU kernel and each CUDA kernel
family (forced through fusedattn.backends.force, so the plan must say it).
Tests take the `backend` fixture (conftest.py) and check through it; a case
the backend does not take (a dtype it lacks, a head dim above its largest) is skipped, saying why."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fusedattn

from .attention_cases import DTYPES, Case, check_backward, check_forward, make_inputs, make_sinks


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str  # "cpu", "sm80" or "sm90"

    @property
    def device(self) -> str:
        return "cpu" if self.name == "cpu" else "cuda"

    @property
    def dtypes(self) -> list[torch.dtype]:
        from .cuda import GPU_DTYPES

        return DTYPES if self.name == "cpu" else GPU_DTYPES

    @property
    def primary_dtype(self) -> torch.dtype:
        """The dtype of a test that takes one: float32 on the CPU (the tightest floor, and
        the CPU's in-place strided reads), float16 on CUDA."""
        return torch.float32 if self.name == "cpu" else torch.float16

    def require_dtype(self, dtype: torch.dtype) -> None:
        """Skips the test where this backend's device does not take `dtype`."""
        if dtype not in self.dtypes:
            pytest.skip(f"{self.device} takes {[str(d)[6:] for d in self.dtypes]}, not {str(dtype)[6:]}")

    def require(self, case: Case, backward: bool = False) -> None:
        """Skips the test where this backend's device does not take the case's
        dtype or head dims (in the forward, or with `backward` the backward too)."""
        self.require_dtype(case.dtype)
        if self.device == "cuda":
            from .cuda import kernel_head_dim

            # Past these the gemm family serves the call (tests/test_gemm_family.py).
            if kernel_head_dim(case, backward) is None:  # below the largest, the kernels run it padded
                pytest.skip(f"cuda's {'backward' if backward else 'forward'} kernels take head dims up to their "
                            f"largest, not d={case.head_dim}, d_v={case.head_dim_v or case.head_dim}")

    def check_forward(self, case: Case):
        """The forward of the case on this backend against the reference, its plan asserted."""
        self.require(case)
        if self.device == "cuda":
            from .cuda import check_cuda

            return check_cuda(case)
        q, k, v, mask = make_inputs(case)
        plan = fusedattn.plan(q, k, v, mask, case.is_causal, case.scale, window=case.window, softcap=case.softcap,
                              sinks=make_sinks(case))
        assert plan["family"] == "cpu"
        return check_forward(case)

    def check_backward(self, case: Case):
        """The backward of the case on this backend against autograd of the reference, its plan asserted."""
        self.require(case, backward=True)
        if self.device == "cuda":
            from .cuda import check_cuda_backward

            return check_cuda_backward(case)
        q, k, v, mask = make_inputs(case)
        plan = fusedattn.plan(q, k, v, mask, case.is_causal, case.scale, backward=True, window=case.window,
                              softcap=case.softcap, sinks=make_sinks(case))
        assert plan["family"] == "cpu"
        return check_backward(case)

    def forward(self, q, k, v, attn_mask=None, is_causal=False, scale=None):
        """torch.ops.fusedattn.forward on this backend (a CUDA family forced, as an argument)."""
        family = None if self.name == "cpu" else self.name
        return torch.ops.fusedattn.forward(q, k, v, attn_mask, is_causal, scale, family)

    def require_plan(self, q, k, v, attn_mask=None, is_causal=False, scale=None, backward=False) -> None:
        """Skips the test where this backend's family refuses the call, with the planner's reason
        (that a forced family refuses, rather than falls back, helpers.cuda's checks test)."""
        try:
            fusedattn.plan(q, k, v, attn_mask, is_causal, scale, backward=backward)
        except RuntimeError as e:
            pytest.skip(str(e).splitlines()[0])

    def inputs(self, case: Case, requires_grad=False):
        self.require(case, backward=requires_grad)
        return make_inputs(case, self.device, requires_grad=requires_grad)
