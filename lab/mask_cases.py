"""The dense bool masks the profiling tools lay over a call: `fusedattn bench
--mask`'s kinds (window:W, docs:K, keypad, causal_keypad, random:P) and
`full` (every entry visible, so every tile is whole: what a mask costs when
it hides nothing). Imported by kernel_breakdown.py and profile_cases.py."""

from __future__ import annotations

import torch

from fusedattn import bench_mask

KINDS_HELP = "a `fusedattn bench --mask` kind, or full (a [B,1,1,N] mask hiding nothing)"


def dense_mask(kind: str, batch: int, n: int, device) -> torch.Tensor:
    """The kind's dense bool mask over a [batch, H, n, n] call, in its broadcast shape."""
    if kind == "full":
        return torch.ones(batch, 1, 1, n, dtype=torch.bool, device=device)
    (parsed,) = bench_mask.parse_kinds([kind])
    mod, _ = bench_mask.mask_mod(parsed, batch, n, device)
    return bench_mask.dense_mask(mod, batch, n, device)
