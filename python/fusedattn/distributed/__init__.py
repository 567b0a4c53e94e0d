"""Context parallelism: attention over a sequence split across the ranks of a
``torch.distributed`` group (gloo on the CPU, NCCL on CUDA).

- :func:`ring_attention` on each rank's shards of q, k and v;
- :func:`shard` / :func:`unshard` / :func:`positions` for the ``contiguous``
  and ``zigzag`` layouts (zigzag balances causal work over the ranks);
- :func:`context_parallel`: a ``with`` block in which ``fusedattn.attention``
  calls run on the ring, so a model needs no change.
"""

from .layout import LAYOUTS, positions, shard, unshard
from .ring import ring_attention
from .routing import context_parallel

__all__ = ["LAYOUTS", "context_parallel", "positions", "ring_attention", "shard", "unshard"]
