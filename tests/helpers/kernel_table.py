"""cpp/generate_kernels.py's table, which the library is built from, read by
the tests: the head dims each kernel is instantiated for, and the feature grid's."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path


@functools.cache
def generated_table() -> dict[str, tuple[int, ...]]:
    """The head dims of the table, by kernel (the names instantiated_head_dims takes)."""
    path = Path(__file__).resolve().parents[2] / "cpp" / "generate_kernels.py"
    spec = importlib.util.spec_from_file_location("generate_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = {kernel: dims for kernel, (_, _, dims, _) in module.KERNELS.items()}
    table.update({name.lower(): dims for name, dims in module.VARIANTS.items()})
    return table


# The head dims the feature tests run every backend at: those every family
# builds natively, forward and backward (sm80's, which sm90 pads where it lacks one).
FEATURE_HEAD_DIMS = sorted(set(generated_table()["sm80_forward"]) & set(generated_table()["sm80_backward"]))
