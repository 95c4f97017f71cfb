"""Radix-tree prefix cache over KV pages, matched a whole page at a time. A request locks the node
its prefix ends at, which pins the path; unlocked leaves are evicted least recently used first.

A cache salt (SamplingParams.cache_salt) names a tree of its own: a request matches and inserts only
under its salt, so a client cannot learn from a cache hit (its `cached_tokens`, or its speed) what
another salt's requests sent. Unsalted requests share one tree, which is never evicted as a whole;
a salted tree goes once its last page has.

With KV tiers (runtime.scheduler.tiers.Tiers, SGLang's HiCache) a node's pages may also, or only, be in
host memory, and whole pages may be in files on disk. The tree says where each span lives: `pages` on
the device, `host` in the host tier. Device residency is closed under prefixes (a device leaf goes
before its parent), so a match takes the device part of its path, then loads the host part back, then
looks for the next pages' files (Tiers.on_disk) and reads them in through the host tier. Evicting a
device leaf demotes it: a node with no host copy is stored first. Evicting a host leaf saves it to disk
under write_back (under write_through it was saved when stored). Each copy is a KVMove that goes out
with the next plan, ahead of its forward, so whatever a step reads was loaded before it."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from runtime.scheduler.pages import PageAllocator
from runtime.scheduler.tiers import Tiers, chain_keys, root_key
from runtime.step import HostEntry, KVMove

_clock = itertools.count()


class RadixNode:
    __slots__ = ("children", "parent", "tokens", "pages", "host", "keys", "lock_ref", "last_used")

    def __init__(
        self,
        tokens: tuple[int, ...] = (),
        pages: list[int] | None = None,
        parent: RadixNode | None = None,
        host: list[int] | None = None,
        keys: list[bytes] | None = None,
    ) -> None:
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.tokens = tokens
        self.pages = pages or []  # on the device: none once evicted from it
        self.host = host or []  # in the host tier (KV tiers only)
        self.keys = keys or []  # each page's chain key (KV tiers only); a root's: its own, the chain's start
        self.lock_ref = 0
        self.last_used = next(_clock)


class Match(NamedTuple):
    """A prefix found in the cache: its device pages (host and disk pages already loaded back), the node it ends
    at, and how many of its tokens came from the host tier and from disk."""

    pages: list[int]
    node: RadixNode
    host_tokens: int = 0
    disk_tokens: int = 0


class RadixCache:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        tiers: Tiers | None = None,
        replaced: Callable[[list[int], list[int]], None] | None = None,
    ) -> None:
        """`replaced`: told of an inserted request's pages and the tree's pages of the same tokens, before the
        request's are freed (the window pool keeps whichever window pages are still paired)."""
        self.allocator = allocator
        self.replaced = replaced
        self.page_size = page_size
        self.tiers = tiers
        self.root = self._new_root(None)
        self.salted: dict[bytes, RadixNode] = {}  # each salt's root by its key, until an eviction finds it bare and unlocked
        self.cached_pages = 0  # device pages the tree holds
        self.host_cached_pages = 0  # host pages it holds
        self.moves: list[KVMove] = []  # copies for the next plan
        self._sent: dict[int, list[KVMove]] = {}  # by step in flight
        self._unconfirmed: set[int] = set()  # host pages whose stores have not been answered: no load reads them

    def _new_root(self, salt: str | None) -> RadixNode:
        root = RadixNode(keys=[root_key(salt)])
        root.lock_ref = 1 if salt is None else 0  # the shared root is never evicted
        return root

    def _root(self, salt: str | None, create: bool) -> RadixNode | None:
        if salt is None:
            return self.root
        key = root_key(salt)
        root = self.salted.get(key)
        if root is None and create:
            root = self.salted[key] = self._new_root(salt)
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
        n = at // self.page_size
        upper = RadixNode(node.tokens[:at], node.pages[:n], node.parent, node.host[:n], node.keys[:n])
        upper.lock_ref, upper.last_used = node.lock_ref, node.last_used
        assert node.parent is not None  # the root is never split
        node.parent.children[self._first_page(upper.tokens)] = upper
        node.tokens, node.pages, node.host, node.keys, node.parent = node.tokens[at:], node.pages[n:], node.host[n:], node.keys[n:], upper
        upper.children[self._first_page(node.tokens)] = node
        return upper

    def _walk(self, tokens: Sequence[int], root: RadixNode) -> Iterator[tuple[RadixNode, int]]:
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

    def match(self, tokens: Sequence[int], salt: str | None = None) -> Match:
        """The longest page-aligned prefix of `tokens` cached under `salt`, on the device once the moves queued
        now have run (host and disk pages are loaded as far as the device has room)."""
        pages: list[int] = []
        root = self._root(salt, create=self.tiers is not None and self.tiers.disk is not None)  # disk may hold its pages
        if root is None:  # nothing cached under this salt: the shared root stands in as the node to lock
            return Match(pages, self.root)
        node, root.last_used, in_host, unconfirmed = root, next(_clock), [], False
        for child, _ in self._walk(tokens, root):
            if child.pages:
                pages += child.pages
                node = child
            elif self._unconfirmed.isdisjoint(child.host):  # device residency is closed under prefixes: the rest is host
                in_host.append(child)
            else:  # its store may yet be lost with the engine: recomputed rather than loaded
                unconfirmed = True
                break
        if self.tiers is None:
            return Match(pages, node)
        end = in_host[-1] if in_host else node
        self.lock(end)  # nothing on the path is evicted while room is made for it
        try:
            loaded = self._load(in_host, pages)
            host_tokens = sum(len(n.tokens) for n in in_host[:loaded])
            if loaded < len(in_host):
                return Match(pages, in_host[loaded - 1] if loaded else node, host_tokens)
            from_disk = self._read_from_disk(end, tokens) if self.tiers.disk is not None and not unconfirmed else None
        finally:
            self.unlock(end)
        if from_disk is None:
            return Match(pages, end, host_tokens)
        return Match(pages + from_disk.pages, from_disk, host_tokens, len(from_disk.tokens))

    def _load(self, nodes: list[RadixNode], pages: list[int]) -> int:
        """Device pages for each host-only node in turn, filled from its host copy, until the device has no room;
        their pages are appended to `pages`. Returns how many nodes were loaded."""
        for loaded, node in enumerate(nodes):
            device = self._device_pages(len(node.host))
            if device is None:
                return loaded
            node.pages = device
            self.cached_pages += len(device)
            self.moves.append(KVMove("load", device, list(node.host)))
            pages += device
        return len(nodes)

    def _read_from_disk(self, end: RadixNode, tokens: Sequence[int]) -> RadixNode | None:
        """The whole pages after `end` that disk holds, read into the host tier and loaded to the device as a new
        leaf under `end`; None where the next page has no file, or there is no room."""
        assert self.tiers is not None
        offset = self._offset(end)
        whole = (len(tokens) - offset) // self.page_size
        keys = []
        for key in chain_keys(end.keys[-1], tokens[offset : offset + whole * self.page_size], self.page_size):
            if not self.tiers.on_disk(key):
                break
            keys.append(key)
        if not keys:
            return None
        host = self._host_pages(len(keys))
        if host is None:
            return None
        device = self._device_pages(len(keys))
        if device is None:
            self.tiers.host.free(host)
            return None
        leaf = RadixNode(tuple(tokens[offset : offset + len(keys) * self.page_size]), device, end, host, keys)
        end.children[self._first_page(leaf.tokens)] = leaf
        self.cached_pages += len(device)
        self.host_cached_pages += len(host)
        self.moves.append(KVMove("read", [], host, keys))
        self.moves.append(KVMove("load", device, list(host)))
        return leaf

    @staticmethod
    def _offset(node: RadixNode) -> int:
        """How many tokens lie on the path from the root down to `node`, its own included."""
        tokens = 0
        while node.parent is not None:
            tokens += len(node.tokens)
            node = node.parent
        return tokens

    def _device_pages(self, count: int) -> list[int] | None:
        if count > self.allocator.num_free:
            self.evict(count - self.allocator.num_free)
        return self.allocator.alloc(count)

    def insert(self, tokens: Sequence[int], pages: list[int], salt: str | None = None) -> int:
        """Take ownership of `pages` (the KV of `tokens`) under `salt`, freeing duplicates; returns tokens cached before."""
        assert len(tokens) == len(pages) * self.page_size
        if not tokens:
            return 0
        root = self._root(salt, create=True)
        assert root is not None  # created
        node, root.last_used, covered = root, next(_clock), 0
        for node, offset in self._walk(tokens, root):
            mine = pages[offset // self.page_size : offset // self.page_size + len(node.tokens) // self.page_size]
            if node.pages:
                if self.replaced is not None:
                    self.replaced(mine, node.pages)
                self.allocator.free(p for p, cached in zip(mine, node.pages) if p != cached)
            else:  # only in the host tier: it takes these as its device copy
                node.pages = list(mine)
                self.cached_pages += len(mine)
            covered = offset + len(node.tokens)
        if covered < len(tokens):
            rest = tuple(tokens[covered:])
            keys = chain_keys(node.keys[-1], rest, self.page_size) if self.tiers is not None else None
            leaf = RadixNode(rest, pages[covered // self.page_size :], node, keys=keys)
            node.children[self._first_page(leaf.tokens)] = leaf
            self.cached_pages += len(leaf.pages)
            if self.tiers is not None and self.tiers.write_through:
                self._store(leaf)
        return covered

    def _store(self, node: RadixNode) -> None:
        """A host copy of the node's device pages (and under write_through, with a disk, its files), where the host
        tier has room."""
        assert self.tiers is not None
        host = self._host_pages(len(node.pages))
        if host is None:
            return
        node.host = host
        self.host_cached_pages += len(host)
        parent = node.parent
        assert parent is not None  # a root has no pages
        position = self._offset(parent) // self.page_size
        self.moves.append(KVMove("store", list(node.pages), host, list(node.keys), parent.keys[-1], position, list(node.tokens)))
        self._unconfirmed.update(host)
        if self.tiers.write_through and self.tiers.disk is not None:
            self.moves.append(KVMove("save", [], list(host), list(node.keys)))

    def _host_pages(self, count: int) -> list[int] | None:
        """Host pages, evicting the least recently used host-only leaves to make room."""
        assert self.tiers is not None
        host = self.tiers.host
        if count > host.num_free:
            leaves = [(n.last_used, id(n), n) for n in self._nodes() if self._host_leaf(n)]
            heapq.heapify(leaves)
            while count > host.num_free and leaves:
                _, _, leaf = heapq.heappop(leaves)
                if not self._host_leaf(leaf):  # a load gave it device pages meanwhile
                    continue
                if not self.tiers.write_through and self.tiers.disk is not None:
                    self.moves.append(KVMove("save", [], list(leaf.host), list(leaf.keys)))
                parent = leaf.parent
                self._remove(leaf)
                if parent is not None and self._host_leaf(parent):
                    heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        return host.alloc(count)

    @staticmethod
    def _host_leaf(node: RadixNode) -> bool:
        return bool(node.host) and not node.pages and not node.children and node.lock_ref == 0

    def _drop_host(self, node: RadixNode) -> None:
        """The node's host copy goes back to the host tier's free pages."""
        if node.host:
            assert self.tiers is not None
            self.tiers.host.free(node.host)
            self.host_cached_pages -= len(node.host)
            node.host = []

    def _remove(self, node: RadixNode) -> None:
        """Out of the tree with its subtree (whose device pages are gone already): their host pages are freed."""
        assert node.parent is not None
        del node.parent.children[self._first_page(node.tokens)]
        stack = [node]
        while stack:
            gone = stack.pop()
            stack.extend(gone.children.values())
            self._drop_host(gone)
            assert not gone.pages  # device residency is closed under prefixes

    def _prune(self, drop: Callable[[RadixNode], bool]) -> None:
        """Every node, top down from the roots: one that `drop` says goes leaves the tree with its subtree (which
        is not visited); the others are descended into."""
        stack = [self.root, *self.salted.values()]
        while stack:
            for child in list(stack.pop().children.values()):
                if drop(child):
                    self._remove(child)
                else:
                    stack.append(child)

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

    def _nodes(self) -> Iterator[RadixNode]:
        stack = [self.root, *self.salted.values()]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    @staticmethod
    def _device_leaf(node: RadixNode) -> bool:
        return bool(node.pages) and node.lock_ref == 0 and not any(child.pages for child in node.children.values())

    def evict(self, num_pages: int, demote: bool = True) -> int:
        """Free at least `num_pages` device pages from unlocked device leaves, oldest first; returns pages freed.
        With KV tiers a leaf is demoted (`demote`): stored to the host tier where it has no copy there yet, and
        kept in the tree as long as it has one."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if self._device_leaf(n)]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            if parent is None or not self._device_leaf(leaf):  # a root; or locked again meanwhile
                continue
            if demote and self.tiers is not None and not leaf.host:
                self._store(leaf)
            self.allocator.free(leaf.pages)
            freed += len(leaf.pages)
            self.cached_pages -= len(leaf.pages)
            leaf.pages = []
            if not leaf.host:
                self._remove(leaf)
            if self._device_leaf(parent):
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        self._sweep_salts()
        return freed

    def _sweep_salts(self) -> None:
        self.salted = {key: root for key, root in self.salted.items() if root.children or root.lock_ref}  # bare ones go

    def flush(self) -> int:
        """Every unlocked page out of the device, and out of the host tier, with nothing demoted; disk keeps its files."""
        freed = self.evict(self.cached_pages, demote=False)
        self._prune(lambda node: not node.pages and node.lock_ref == 0)
        self._sweep_salts()
        return freed

    # -- the moves' lifecycle across the engine's steps ------------------------------------------------

    def take_moves(self, step: int) -> list[KVMove]:
        """The copies queued since the last plan, for plan `step`; kept until its results come (answered)."""
        if self.moves:
            self._sent[step], self.moves = self.moves, []
        return self._sent.get(step, [])

    def answered(self, step: int) -> None:
        for move in self._sent.pop(step, ()):
            if move.kind == "store":
                self._unconfirmed.difference_update(move.host)

    def reopen(self) -> None:
        """The engine died with the plans in flight, which it may or may not have run. A store among them leaves
        its pages' nodes without a host copy (no load read one: match passes unconfirmed copies by); its loads
        and reads are queued again, ahead of what is queued, for the nodes that hold their pages now (a split
        may have cut one)."""
        lost = [move for step in sorted(self._sent) for move in self._sent[step]]
        self._sent.clear()
        stored = {page for move in lost if move.kind == "store" for page in move.host}
        loaded = {page for move in lost if move.kind == "load" for page in move.device}
        read = {page for move in lost if move.kind == "read" for page in move.host}
        self._unconfirmed -= stored
        reads, loads = [], []

        def lost_copy(node: RadixNode) -> bool:
            """Queues its lost read and load again; True where its host copy was lost and it has no other."""
            if not stored.isdisjoint(node.host):
                self._drop_host(node)
                return not node.pages
            if not read.isdisjoint(node.host):
                reads.append(KVMove("read", [], list(node.host), list(node.keys)))
            if not loaded.isdisjoint(node.pages) and node.host:
                loads.append(KVMove("load", list(node.pages), list(node.host)))
            return False

        self._prune(lost_copy)
        self.moves = reads + loads + self.moves

    def restore(self, entries: list[HostEntry]) -> None:
        """The host tier's tree from its index (a new scheduler over a surviving host tier): each chain of pages
        that starts at a root, host-only; pages in no such chain go back to the free list."""
        assert self.tiers is not None
        by_key = {key: (page, parent, position, tokens) for page, key, parent, position, tokens in entries}
        used = {page for page, *_ in by_key.values()}
        self.tiers.host.take(used)
        children: dict[bytes, list[bytes]] = {}
        for key, (_, parent, _, _) in by_key.items():
            children.setdefault(parent, []).append(key)
        kept: set[int] = set()
        for key, (page, parent, position, tokens) in by_key.items():
            if position != 0:
                continue
            root = self.root if parent == self.root.keys[0] else self.salted.setdefault(parent, RadixNode(keys=[parent]))
            stack = [(root, key)]
            while stack:
                under, key = stack.pop()
                page, _, _, tokens = by_key[key]
                node = RadixNode(tuple(tokens), [], under, [page], [key])
                if (twin := under.children.get(self._first_page(node.tokens))) is not None:
                    node = twin  # the same tokens stored twice: one copy is kept
                else:
                    under.children[self._first_page(node.tokens)] = node
                    kept.add(page)
                    self.host_cached_pages += 1
                stack.extend((node, child) for child in children.get(key, ()))
        self.tiers.host.free(sorted(used - kept))
