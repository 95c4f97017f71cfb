"""Page ids of the KV pool: the scheduler's bookkeeping; the tensors live in the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterable


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.on_free: Callable[[list[int]], None] | None = None  # told of pages as they are freed (their window pages go too)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low ids first
        self._in_use = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        pages = sorted(self._free.pop() for _ in range(count))  # in order: the KV tiers copy pages in a row at once
        for page in pages:
            self._in_use[page] = 1
        return pages

    def take(self, pages: Iterable[int]) -> None:
        """Mark these free pages used (the KV they hold is adopted, not allocated anew)."""
        taken = set(pages)
        if any(self._in_use[page] for page in taken):
            raise RuntimeError("a page taken is in use")
        for page in taken:
            self._in_use[page] = 1
        self._free = [page for page in self._free if page not in taken]

    def free(self, pages: Iterable[int]) -> None:
        freed = list(pages)
        for page in freed:
            if not self._in_use[page]:
                raise RuntimeError(f"page {page} freed twice")
            self._in_use[page] = 0
            self._free.append(page)
        if self.on_free is not None:
            self.on_free(freed)
