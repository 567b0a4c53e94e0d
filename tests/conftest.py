import os
import sys

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=15, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def cuda_kernels_registered() -> bool:
    from fusedattn.ops import has_kernel

    return has_kernel("forward", "cuda")


def pytest_collection_modifyitems(config, items):
    """GPU tests (marker `gpu`) run only with a CUDA device and CUDA kernels."""
    if not torch.cuda.is_available():
        reason = "no CUDA device"
    elif not cuda_kernels_registered():
        reason = "fusedattn was built without CUDA kernels"
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
