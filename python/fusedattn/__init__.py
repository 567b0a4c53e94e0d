"""fusedattn: exact fused multi-head attention for PyTorch.

Importing the package loads the compiled operator library, which registers
``torch.ops.fusedattn.forward`` and ``torch.ops.fusedattn.backward``.
"""

from pathlib import Path

import torch


def _load_library() -> None:
    libs = sorted(Path(__file__).parent.glob("_fusedattn*.so"))
    if not libs:
        raise ImportError(
            "fusedattn: the compiled operator library (_fusedattn.so) is missing next to "
            f"{__file__}; install the package with "
            "`pip install --no-build-isolation .` from the repository root"
        )
    torch.ops.load_library(str(libs[0]))


_load_library()

from . import backends, distributed, gguf_blocks, nn, ops, reference  # noqa: E402  (ops and gguf_blocks register fake functions)
from .blockmask import BlockMask, block_mask  # noqa: E402
from .ops import attention, attention_varlen, attention_with_kvcache, plan, plan_kvcache, plan_varlen  # noqa: E402

__all__ = ["BlockMask", "attention", "attention_varlen", "attention_with_kvcache", "backends", "block_mask",
           "distributed", "nn", "ops", "plan", "plan_kvcache", "plan_varlen", "reference"]
__version__ = "0.1.0"
