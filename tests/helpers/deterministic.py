"""torch.use_deterministic_algorithms(True) for the length of a `with` block."""

import contextlib

import torch


@contextlib.contextmanager
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)
