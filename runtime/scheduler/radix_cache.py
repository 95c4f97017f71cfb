"""Radix-tree prefix cache over KV pages, matched a whole page at a time. A request locks the node
its prefix ends at, which pins the path; unlocked leaves are evicted least recently used first.

A cache salt (SamplingParams.cache_salt) names a tree of its own: a request matches and inserts only
under its salt, so a client cannot learn from a cache hit (its `cached_tokens`, or its speed) what
another salt's requests sent. Unsalted requests share one tree, which is never evicted as a whole;
a salted tree goes once its last page has."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from runtime.scheduler.pages import PageAllocator

_clock = itertools.count()


class RadixNode:
    __slots__ = ("children", "parent", "tokens", "pages", "lock_ref", "last_used")

    def __init__(self, tokens: tuple[int, ...] = (), pages: list[int] | None = None, parent: RadixNode | None = None) -> None:
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.tokens = tokens
        self.pages = pages or []
        self.lock_ref = 0
        self.last_used = next(_clock)


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.root = RadixNode()
        self.root.lock_ref = 1  # never evicted
        self.salted: dict[str, RadixNode] = {}  # each salt's root, until an eviction finds it bare and unlocked
        self.cached_pages = 0

    def _root(self, salt: str | None, create: bool) -> RadixNode | None:
        if salt is None:
            return self.root
        root = self.salted.get(salt)
        if root is None and create:
            root = self.salted[salt] = RadixNode()
        return root

    def _first_page(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(tokens[: self.page_size])

    def _shared_length(self, node: RadixNode, tokens: Sequence[int]) -> int:
        """How many leading tokens `node` shares with `tokens`, rounded down to whole pages."""
        n = 0
        for a, b in zip(node.tokens, tokens):
            if a != b:
                break
            n += 1
        return n - n % self.page_size

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut `node` after `at` tokens; returns the new upper half."""
        pages_at = at // self.page_size
        upper = RadixNode(node.tokens[:at], node.pages[:pages_at], node.parent)
        upper.lock_ref, upper.last_used = node.lock_ref, node.last_used
        assert node.parent is not None  # the root is never split
        node.parent.children[self._first_page(upper.tokens)] = upper
        node.tokens, node.pages, node.parent = node.tokens[at:], node.pages[pages_at:], upper
        upper.children[self._first_page(node.tokens)] = node
        return upper

    def _walk(self, tokens: Sequence[int], root: RadixNode):
        """Follow `tokens` down from `root`, splitting where they part: yields (node, offset) per node."""
        node, offset = root, 0
        end = len(tokens) - len(tokens) % self.page_size
        while offset < end:
            child = node.children.get(self._first_page(tokens[offset:]))
            if child is None:
                return
            shared = self._shared_length(child, tokens[offset:end])
            if shared < len(child.tokens):
                child = self._split(child, shared)
            child.last_used = next(_clock)
            yield child, offset
            node, offset = child, offset + shared

    def match(self, tokens: Sequence[int], salt: str | None = None) -> tuple[list[int], RadixNode]:
        """Pages of the longest page-aligned prefix of `tokens` cached under `salt`, and the node it ends at."""
        pages: list[int] = []
        root = self._root(salt, create=False)
        if root is None:  # nothing cached under this salt: the shared root stands in as the node to lock
            return pages, self.root
        node, root.last_used = root, next(_clock)
        for node, _ in self._walk(tokens, root):
            pages += node.pages
        return pages, node

    def insert(self, tokens: Sequence[int], pages: list[int], salt: str | None = None) -> int:
        """Take ownership of `pages` (the KV of `tokens`) under `salt`, freeing duplicates; returns tokens cached before."""
        assert len(tokens) == len(pages) * self.page_size
        if not tokens:
            return 0
        root = self._root(salt, create=True)
        assert root is not None  # created
        node, root.last_used, covered = root, next(_clock), 0
        for node, offset in self._walk(tokens, root):
            mine = pages[offset // self.page_size : offset // self.page_size + len(node.pages)]
            self.allocator.free(p for p, cached in zip(mine, node.pages) if p != cached)
            covered = offset + len(node.tokens)
        if covered < len(tokens):
            leaf = RadixNode(tuple(tokens[covered:]), pages[covered // self.page_size :], node)
            node.children[self._first_page(leaf.tokens)] = leaf
            self.cached_pages += len(leaf.pages)
        return covered

    def lock(self, node: RadixNode | None) -> None:
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode | None) -> None:
        while node is not None:
            node.lock_ref -= 1
            node = node.parent

    def evictable_pages(self) -> int:
        return sum(len(n.pages) for n in self._nodes() if n.lock_ref == 0)

    def _nodes(self):
        stack = [self.root, *self.salted.values()]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves, oldest first; returns pages freed."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            _, _, leaf = heapq.heappop(leaves)
            if leaf.parent is None:  # a salt's root: swept below
                continue
            self.allocator.free(leaf.pages)
            freed += len(leaf.pages)
            self.cached_pages -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[self._first_page(leaf.tokens)]
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        self.salted = {salt: root for salt, root in self.salted.items() if root.children or root.lock_ref}  # bare ones go
        return freed

    def flush(self) -> int:
        return self.evict(self.cached_pages)
