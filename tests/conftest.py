import os

import pytest
import torch
from hypothesis import settings

import fusedattn

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


def forced_family(family: str):
    """A fixture body: the family forced (fusedattn.backends.force) for the
    test; sm90 is skipped where this build or GPU lacks it."""
    from helpers.cuda import sm90_available

    if family == "sm90" and not sm90_available():
        pytest.skip("this build or GPU has no sm90 kernels")
    with fusedattn.backends.force(family):
        yield family


@pytest.fixture(params=["cpu", pytest.param("sm80", marks=pytest.mark.gpu),
                        pytest.param("sm90", marks=pytest.mark.gpu)])
def backend(request):
    """The CPU kernel and each CUDA family in turn (helpers.backends.Backend): a
    feature test that takes it runs on all three, its checks asserting the plan."""
    from helpers.backends import Backend

    if request.param == "cpu":
        yield Backend("cpu")
    else:
        for _ in forced_family(request.param):
            yield Backend(request.param)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """The CPU and CUDA in turn, for a feature whose CUDA variants are parameters
    of their own (the KV-cache tests)."""
    return request.param


@pytest.fixture(params=["sm80", "sm90"])
def cuda_family(request):
    """Each CUDA kernel family in turn: a test that takes it runs on both, and
    its checks assert the plan (helpers.cuda.check_cuda)."""
    yield from forced_family(request.param)


@pytest.fixture
def sm90():
    yield from forced_family("sm90")
