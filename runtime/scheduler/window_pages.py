"""The sliding-window layers' pages (SGLang's SWA pool, vLLM's sliding-window KV cache group). Full pages keep
their ids: the page table and the prefix cache speak of them alone. Beside a full page whose tokens a request
may still see through its window stands a window page of the window pool, where the sliding-window layers keep
those tokens' K and V; the engine learns each pairing from the plan (StepPlan.window_pages).

A running request holds the window pages from the first its next query sees on (`slide` gives back those it
has passed). A window page no request holds stays paired, idle, so that the prefix cache can still start a
request after its tokens, until the window pool needs it back; its full page is then a tombstone, after which no
request may start (`usable`). A full page that is freed takes its window page with it."""

from __future__ import annotations

from runtime.scheduler.pages import PageAllocator


class WindowPages:
    def __init__(self, num_pages: int, window: int, page_size: int, prefill_pages: int = 0) -> None:
        """`window`: the longest sliding window of the model's layers, in tokens (a query and those before it);
        `prefill_pages`: the most a prompt's prefill holds at once (EngineConfig.window_prefill_pages), which a request
        is admitted only with room for."""
        self.allocator = PageAllocator(num_pages)
        self.window, self.page_size, self.prefill_pages = window, page_size, prefill_pages
        self.of: dict[int, int] = {}  # full page -> its window page
        self.holders: dict[int, int] = {}  # full page -> running requests that hold its window page
        self.idle: dict[int, None] = {}  # paired full pages that no request holds, the longest idle first
        self.assigned: list[tuple[int, int]] = []  # pairings made since the last plan took them

    def first_seen(self, position: int) -> int:
        """The first page whose tokens a query at `position` sees (or any query after it)."""
        return max(0, position - self.window + 1) // self.page_size

    @property
    def num_free(self) -> int:
        """Window pages to be had: free ones, and idle ones taken back."""
        return self.allocator.num_free + len(self.idle)

    @property
    def num_held(self) -> int:
        return len(self.of) - len(self.idle)

    def assign(self, pages: list[int]) -> bool:
        """Window pages for a request's new full `pages`, held by it; False (and nothing done) where too few are to be
        had. Idle ones are taken back first where the free ones fall short, the longest idle first."""
        if len(pages) > self.num_free:
            return False
        for full in list(self.idle)[: max(0, len(pages) - self.allocator.num_free)]:
            self._unpair(full)
        window = self.allocator.alloc(len(pages))
        assert window is not None  # made room above
        for full, page in zip(pages, window):
            self.of[full], self.holders[full] = page, 1
            self.assigned.append((full, page))
        return True

    def hold(self, pages: list[int]) -> None:
        """A request starting after a cached prefix holds the window pages of its first window (usable says they are paired)."""
        for full in pages:
            self.holders[full] = self.holders.get(full, 0) + 1
            self.idle.pop(full, None)

    def release(self, pages: list[int]) -> None:
        """A request lets go of these full pages' window pages: past its window, or it stopped running."""
        for full in pages:
            if full not in self.holders:  # a tombstone a request never held
                continue
            self.holders[full] -= 1
            if not self.holders[full]:
                del self.holders[full]
                self.idle[full] = None

    def drop(self, pages: list[int]) -> None:
        """These full pages were freed: their window pages are free again."""
        for full in pages:
            if full in self.of:
                self.holders.pop(full, None)
                self._unpair(full)

    def replace(self, own: list[int], cached: list[int]) -> None:
        """A finished request's pages `own` repeat the prefix cache's `cached` (the same tokens), and are freed next:
        a cached page whose window page was taken back takes over its twin's."""
        for mine, theirs in zip(own, cached):
            if mine != theirs and theirs not in self.of and mine in self.idle:
                page = self.of.pop(mine)
                del self.idle[mine]
                self.of[theirs] = page
                self.idle[theirs] = None
                self.assigned.append((theirs, page))

    def usable(self, pages: list[int]) -> int:
        """How many leading pages of a cached prefix a request can start after: the most k whose window before token
        k·page_size is paired throughout."""
        for k in range(len(pages), 0, -1):
            if all(full in self.of for full in pages[self.first_seen(k * self.page_size) : k]):
                return k
        return 0

    def take_assigned(self) -> list[tuple[int, int]]:
        assigned, self.assigned = self.assigned, []
        return assigned

    def _unpair(self, full: int) -> None:
        self.idle.pop(full, None)
        self.allocator.free([self.of.pop(full)])
