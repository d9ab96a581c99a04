"""Host-side page allocator for the paged KV pool.

Pages are plain integers indexing axis 1 of the device pool. Page 0 is never
handed out: it is the scratch page that padded batch rows point at, so a
padding row can never read or write a live request's KV.
"""

from __future__ import annotations

import numpy as np


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than a request asked for; nothing was allocated."""


class PageAllocator:
    """Free list plus reference counts (a page shared by a prefix cache has refcount > 1)."""

    SCRATCH_PAGE = 0

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        self._refcount = np.zeros(num_pages, np.int32)
        self._refcount[self.SCRATCH_PAGE] = 1
        # Stack of free pages; popping from the end hands out low page ids first.
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise OutOfPagesError(
                f"KV pool exhausted: asked for {n} pages, {len(self._free)} of {self.num_usable} free"
            )
        pages = [self._free.pop() for _ in range(n)]
        self._refcount[pages] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            if self._refcount[p] <= 0 or p == self.SCRATCH_PAGE:
                raise ValueError(f"retain of page {p}, which is not allocated")
            self._refcount[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p == self.SCRATCH_PAGE or not (0 < p < self.num_pages) or self._refcount[p] <= 0:
                raise ValueError(f"free of page {p}, which is not allocated (double free?)")
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)

    def check_no_leaks(self) -> None:
        """Raises if any page is still held: call when no request is running."""
        if self.num_free != self.num_usable:
            held = [int(p) for p in np.nonzero(self._refcount[1:])[0] + 1]
            raise AssertionError(f"KV page leak: {self.num_usable - self.num_free} pages still held: {held[:16]}")
