"""Forcing the planner's choices, for tests and benchmarks.

The planner picks the kernel family, tiles, decode splits and warps for every
call (``fusedattn.plan`` shows its answer). Inside ``force(...)`` fusedattn's
Python entry points (``attention``, ``attention_with_kvcache``, ``plan``,
``plan_kvcache``, ``nn.MultiheadAttention`` and ``fusedattn.hf``) pass the forced
values to the operators instead; a forced choice that cannot serve a call is an
error, never a silent fallback. The setting is a context variable: each thread
(and each asyncio task) has its own, and the backward of a call runs what its
forward was given. Calling ``torch.ops.fusedattn.*`` directly bypasses it: those
take the same choices as arguments. Code that ``torch.compile`` traces cannot
read the setting: tracing a call inside ``force(...)`` raises, rather than
compiling the planner's choices in its place (pass ``family=`` to the
operators there). The decode choices name CUDA blocks: forced around a call on
CPU tensors they raise.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from typing import Iterator

import torch

from ._compile import assume_constant_result

__all__ = ["FAMILIES", "Forced", "force", "forced"]

# Families a caller may force on CUDA tensors ("cpu" names the CPU's tiled
# kernels). "gemm", on either device: attention from float32 matrix products,
# a block of query rows at a time (forward and backward, dense and packed).
FAMILIES = ("sm80", "sm90", "gemm")


@dataclasses.dataclass(frozen=True)
class Forced:
    """What is forced; None leaves a choice to the planner."""

    family: str | None = None  # "sm80" or "sm90" (CUDA), "cpu" (CPU), "gemm" (both): forward and backward
    decode_warps: int | None = None  # 4 or 8: the decode kernel's warps per block (4 at head dim 128 only)
    decode_merge_in_cluster: bool | None = None  # True: the decode splits must merge in a cluster; False: never


_PLANNER = Forced()
_FORCED: contextvars.ContextVar[Forced] = contextvars.ContextVar("fusedattn_forced", default=_PLANNER)
# force() blocks open in any thread: a module global, which torch.compile
# guards on (it cannot guard on the context variable), so a function compiled
# outside force() is traced again inside it, and that trace raises.
_OPEN_FORCES = 0
_OPEN_FORCES_LOCK = threading.Lock()


@assume_constant_result
def _nothing_forced_while_tracing() -> bool:
    """Run once, eagerly, when torch.compile traces a call: a forced choice
    there would be dropped (Dynamo cannot guard on a context variable), so it
    is an error."""
    if _FORCED.get() != _PLANNER:
        raise RuntimeError(f"fusedattn.backends.force: {_FORCED.get()} does not reach code that torch.compile "
                           "traces; trace it outside force(...), or pass family= to torch.ops.fusedattn.* there")
    return True


def forced() -> Forced:
    """The choices forced in this thread or task (all None outside ``force``);
    while torch.compile traces, all None, and an error if any is forced."""
    if torch.compiler.is_compiling():
        if _OPEN_FORCES:
            _nothing_forced_while_tracing()
        return _PLANNER
    return _FORCED.get()


@contextlib.contextmanager
def force(family: str | None = None, *, decode_warps: int | None = None,
          decode_merge_in_cluster: bool | None = None) -> Iterator[Forced]:
    """Force the planner's choices inside a ``with`` block; nested blocks
    override the fields they set and keep the others (``family="auto"`` hands
    the family back to the planner)."""
    if family is not None and family not in FAMILIES + ("cpu", "auto"):
        raise ValueError(f"fusedattn.backends.force: family must be one of {FAMILIES + ('cpu', 'auto')} or None, "
                         f"got {family!r}")
    if decode_warps is not None and decode_warps not in (4, 8):
        raise ValueError(f"fusedattn.backends.force: decode_warps must be 4, 8 or None, got {decode_warps!r}")
    if decode_merge_in_cluster is not None and not isinstance(decode_merge_in_cluster, bool):
        raise ValueError("fusedattn.backends.force: decode_merge_in_cluster must be True, False or None, "
                         f"got {decode_merge_in_cluster!r}")
    outer = _FORCED.get()
    inner = Forced(
        family=None if family == "auto" else family if family is not None else outer.family,
        decode_warps=decode_warps if decode_warps is not None else outer.decode_warps,
        decode_merge_in_cluster=(decode_merge_in_cluster if decode_merge_in_cluster is not None
                                 else outer.decode_merge_in_cluster),
    )
    global _OPEN_FORCES
    token = _FORCED.set(inner)
    with _OPEN_FORCES_LOCK:
        _OPEN_FORCES += 1
    try:
        yield inner
    finally:
        with _OPEN_FORCES_LOCK:
            _OPEN_FORCES -= 1
        _FORCED.reset(token)
