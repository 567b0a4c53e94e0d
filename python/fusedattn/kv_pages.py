"""The engine's KV cache as pages that requests take and give back.

Every layer keeps its keys and values in tensors of pages ``[pages, Hkv,
page_size, d]``: the caches ``attention_with_kvcache(..., block_table=...)``
reads. A request holds a list of pages (its row of the block table) and gives
them back when it ends.

Prefix caching: a full page can be *named* by a hash of its tokens and of
every token before them, so that a later request whose tokens start the same
takes the page instead of computing it again (a page may then be held by
several requests, which only read it). A named page that nobody holds stays
in the index until a new page is needed and no unnamed one is free; then the
one given back longest ago is reused.
"""

from __future__ import annotations

import collections
import hashlib
from array import array

import torch

__all__ = ["PagePool", "page_keys"]


def page_keys(tokens: list[int], page_size: int, pages: int, keys: list[bytes] | None = None) -> list[bytes]:
    """The names of the first ``pages`` full pages of ``tokens``: page i's is
    a hash of page i - 1's and of its own tokens, so equal names mean equal
    tokens from position 0. ``keys``: names already computed, extended in place."""
    keys = [] if keys is None else keys
    for i in range(len(keys), pages):
        chunk = array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes()
        keys.append(hashlib.sha256((keys[i - 1] if i else b"") + chunk).digest())
    return keys


class PagePool:
    """``pages`` pages of ``page_size`` positions for every layer's keys and
    values (``caches``: a (k, v) pair per layer), their holders and their names."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, pages: int, page_size: int,
                 device: torch.device, dtype: torch.dtype, zeroed: bool = True, spare: int = 0):
        """zeroed=False leaves the pages' memory as allocated, for kernels that
        read no position a sequence has not written: untouched pages then take
        no resident memory. spare: pages past ``pages`` (indices pages ..)
        that no holder takes, for writes nobody reads."""
        if pages < 1 or page_size < 1:
            raise ValueError(f"fusedattn.engine: a KV cache needs at least one page of at least one position, got "
                             f"{pages} pages of {page_size}")
        self.page_size = page_size
        allocate = torch.zeros if zeroed else torch.empty
        self.caches = [tuple(allocate(pages + spare, kv_heads, page_size, head_dim, device=device, dtype=dtype)
                             for _ in range(2)) for _ in range(layers)]
        self._holders = [0] * pages
        self._free = collections.deque(range(pages))  # unnamed and held by nobody
        self._idle = collections.OrderedDict()  # named, held by nobody; given back longest ago first
        self._name_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}

    @property
    def pages(self) -> int:
        return len(self._holders)

    def available(self) -> int:
        """Pages a request can take now (free ones and named ones nobody holds)."""
        return len(self._free) + len(self._idle)

    def usage(self) -> dict:
        """Pages held by requests, named but idle, and free."""
        idle = len(self._idle)
        return {"total": self.pages, "held": self.pages - len(self._free) - idle, "cached": idle,
                "free": len(self._free)}

    def take(self) -> int:
        """A page for one holder to write (a free one, else the idle named page given back longest ago)."""
        if self._free:
            page = self._free.popleft()
        elif self._idle:
            page, _ = self._idle.popitem(last=False)
            del self._page_of[self._name_of.pop(page)]
        else:
            raise RuntimeError("fusedattn.engine: no KV cache page is free (a planner bug: the batcher counts them)")
        self._holders[page] = 1
        return page

    def give_back(self, page: int) -> None:
        self._holders[page] -= 1
        if self._holders[page] == 0:
            if page in self._name_of:
                self._idle[page] = None
            else:
                self._free.append(page)

    def share(self, name: bytes) -> int | None:
        """The page of that name, now held once more; None where none has it."""
        page = self._page_of.get(name)
        if page is not None:
            self._idle.pop(page, None)
            self._holders[page] += 1
        return page

    def name(self, page: int, name: bytes) -> None:
        """Records that ``page`` (full, never written again) holds the tokens
        ``name`` names; where another page has that name already, it keeps it."""
        if name not in self._page_of and page not in self._name_of:
            self._page_of[name], self._name_of[page] = page, name
