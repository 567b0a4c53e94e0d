"""Context parallelism for code written with ``fusedattn.attention``.

Inside ``context_parallel(group, layout)``, every ``fusedattn.attention`` call
(and so ``fusedattn.nn.MultiheadAttention``) runs :func:`ring_attention` over
the group: its q, k and v are taken as this rank's shards of the sequence, laid
out as ``layout`` says (``fusedattn.distributed.shard`` makes them). The ring
takes no ``attn_mask``, ``window``, ``softcap`` or ``sinks`` yet; a call with one raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch

from .layout import check_layout
from .ring import ring_attention

__all__ = ["context_parallel", "routed_attention"]


@dataclasses.dataclass(frozen=True)
class _Route:
    group: object
    layout: str


# A stack in a module global, not a context variable: torch.compile guards on
# what it reads here, so a compiled model recompiles when it enters or leaves
# the block instead of silently attending within its shard. It is the whole
# process's: run no other thread's attention inside the block.
_ROUTES: list[_Route] = []


# ring_attention behind torch.compiler.disable (a graph break: the ring's
# messages cannot be traced), made on first use: the decorator imports
# torch._dynamo, over a second that `import fusedattn` need not pay.
_untraced_ring = None


@contextlib.contextmanager
def context_parallel(group=None, layout: str = "contiguous") -> Iterator[None]:
    """Route ``fusedattn.attention`` calls to the ring over ``group`` (default: the world)."""
    global _untraced_ring
    check_layout(layout, "fusedattn.distributed.context_parallel")
    if _untraced_ring is None:
        _untraced_ring = torch.compiler.disable(ring_attention)
    _ROUTES.append(_Route(group, layout))
    try:
        yield
    finally:
        _ROUTES.pop()


def routed_attention(q, k, v, attn_mask, is_causal, scale, window, softcap=None, sinks=None):
    """The ring's answer to an attention call inside ``context_parallel``; None outside one."""
    if not _ROUTES:
        return None
    if attn_mask is not None or window is not None:
        given = "attn_mask" if attn_mask is not None else f"window={tuple(window)}"
        raise ValueError(f"fusedattn.distributed.context_parallel: the ring takes no attn_mask or window yet "
                         f"(got {given}); express the mask with is_causal or leave the call outside the block")
    if softcap is not None or sinks is not None:
        given = f"softcap={softcap}" if softcap is not None else "sinks"
        raise ValueError(f"fusedattn.distributed.context_parallel: the ring takes no softcap or sinks yet "
                         f"(got {given}); leave the call outside the block")
    route = _ROUTES[-1]
    return _untraced_ring(q, k, v, is_causal, scale, route.group, route.layout)
