"""What fusedattn tells torch.compile, without importing Dynamo when fusedattn is imported:
`torch.compiler.assume_constant_result` imports it (2.7 s on a 2-core CPU, more than torch
itself), which every process would pay, compiling or not."""

from __future__ import annotations

import sys

import torch


def assume_constant_result(fn):
    """torch.compiler.assume_constant_result(fn). Its decorator only marks fn for Dynamo to read
    when it traces a call, so where Dynamo is not loaded yet fn gets the same mark directly
    (tests/test_library.py checks that the two marks agree)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn
