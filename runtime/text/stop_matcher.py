"""Stop strings as one Aho-Corasick automaton, fed a stream's text as it is released: O(1)
amortised per character however many stop strings. Built once per tuple of them and shared."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True, slots=True)
class Automaton:
    """A trie of the stop strings: node 0 is the root, and each node stands for the prefix that reaches it."""

    goto: dict[int, int]  # trie edges, keyed by node * EDGE_KEY + the character's code point: one dict, not one a node
    fail: tuple[int, ...]  # the node of the longest proper suffix that is also a prefix of some stop string
    depth: tuple[int, ...]
    match: tuple[int, ...]  # length of the longest stop string ending here (0: none), so the earliest-starting one


EDGE_KEY = 0x110000  # past every code point


@lru_cache(maxsize=32)
def compile_stops(stops: tuple[str, ...]) -> Automaton:
    """The automaton of `stops`; empty strings are ignored (they would stop before any text)."""
    goto: dict[int, int] = {}
    children: list[list[tuple[int, int]]] = [[]]  # (code point, child) per node, for the breadth-first pass
    depth, ends = [0], [0]
    for stop in stops:
        node = 0
        for code in map(ord, stop):
            if (child := goto.get(node * EDGE_KEY + code)) is None:
                child = goto[node * EDGE_KEY + code] = len(depth)
                children[node].append((code, child))
                children.append([])
                depth.append(depth[node] + 1)
                ends.append(0)
            node = child
        if stop:
            ends[node] = len(stop)
    fail, match = [0] * len(depth), ends[:]
    queue = deque(child for _, child in children[0])  # breadth first: a node's suffixes are shallower, so already done
    while queue:
        node = queue.popleft()
        match[node] = match[node] or match[fail[node]]
        for code, child in children[node]:
            f = fail[node]
            while f and f * EDGE_KEY + code not in goto:
                f = fail[f]
            fail[child] = goto.get(f * EDGE_KEY + code, 0)
            queue.append(child)
    return Automaton(goto, tuple(fail), tuple(depth), tuple(match))


class StopMatcher:
    """One stream's place in its automaton: the longest suffix of the text so far that may begin a stop string."""

    __slots__ = ("automaton", "node")

    def __init__(self, stops: list[str] | tuple[str, ...]) -> None:
        self.automaton = compile_stops(tuple(stops))
        self.node = 0

    @property
    def held(self) -> int:
        """How many trailing characters fed so far could begin a stop string: text to hold back."""
        return self.automaton.depth[self.node]

    def feed(self, text: str) -> int | None:
        """Start of the first stop string completed in `text`, relative to it (negative: began earlier), or None."""
        goto, fail, match = self.automaton.goto, self.automaton.fail, self.automaton.match
        node = self.node
        for i, code in enumerate(map(ord, text)):
            while node and node * EDGE_KEY + code not in goto:
                node = fail[node]
            node = goto.get(node * EDGE_KEY + code, 0)
            if match[node]:
                self.node = 0
                return i + 1 - match[node]
        self.node = node
        return None
